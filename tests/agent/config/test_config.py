"""The agent's configuration: loading, environment overrides, errors, secrets, CLI, schema."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pydantic
import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli import config_cmd as config_cli
from kvpilot.agent.config import (
    AgentConfig,
    ConfigError,
    InstanceConfig,
    LocalRuntimeConfig,
    ProcessRuntimeConfig,
    agent,
    load_config,
    notifiers,
    remediation,
    runtime,
)
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.collectors.vllm_argv import launch_form

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "kvpilot.yaml"
SCHEMA = REPO / "docs" / "kvpilot.schema.json"
MODULE_ARGV = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]


def minimal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "runtime": {"kind": "local", "instances": [{"name": "a", "argv": MODULE_ARGV}]}
    }
    data.update(overrides)
    return data


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def problems(tmp_path: Path, data: Any, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, data), environ)
    return list(caught.value.problems)


def test_example_loads_with_its_local_cpu_vllm() -> None:
    config = load_config(EXAMPLE)
    assert isinstance(config.runtime, LocalRuntimeConfig)
    (instance,) = config.runtime.instances
    assert launch_form(instance.argv) == "module"
    assert instance.url == "http://127.0.0.1:8000"
    assert instance.kvpool_port == 9500
    assert config.notifiers[0].name == "oncall-hook"


def test_defaults() -> None:
    config = AgentConfig.model_validate(minimal())
    assert (config.listen.host, config.listen.port, config.interval_s) == ("127.0.0.1", 8474, 1.0)
    # The local runtime owns its server: the liveness rules restart it by default.
    assert config.rules == RulesConfig.model_validate(
        {"engine_stall": {"action": "restart"}, "requests_deferred": {"action": "restart"}}
    )
    assert config.remediation.light_step_reset_prefix_cache is False
    assert config.api.control_token() is None


def test_models_are_frozen() -> None:
    config = AgentConfig.model_validate(minimal())
    with pytest.raises(pydantic.ValidationError):
        config.listen.port = 1  # type: ignore[misc]


def test_every_field_is_described() -> None:
    missing = []

    def visit(model: type[pydantic.BaseModel]) -> None:
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")

    for module in (agent, notifiers, remediation, runtime):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, pydantic.BaseModel):
                visit(value)
    assert missing == []


def test_typo_at_top_level_names_the_field_and_suggests(tmp_path: Path) -> None:
    found = problems(tmp_path, minimal(remediaton={"dry_run": True}))
    assert found == ["remediaton: unknown field; did you mean 'remediation'?"]


def test_nested_typo_inside_a_tagged_union(tmp_path: Path) -> None:
    data = minimal()
    data["runtime"]["instances"][0]["kvpool_prot"] = 9500
    assert problems(tmp_path, data) == [
        "runtime.instances.0.kvpool_prot: unknown field; did you mean 'kvpool_port'?"
    ]


def test_unknown_field_without_a_close_match(tmp_path: Path) -> None:
    assert problems(tmp_path, minimal(zzz=1)) == ["zzz: unknown field"]


def test_out_of_range_value_names_path_and_value(tmp_path: Path) -> None:
    data = minimal(rules={"fragmentation": {"kv_blocks": {"threshold_ratio": 3}}})
    (problem,) = problems(tmp_path, data)
    assert problem.startswith("rules.fragmentation.kv_blocks.threshold_ratio: Input should be")
    assert problem.endswith("(got 3)")


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    found = problems(tmp_path, minimal(interval_s=0, listen={"port": 70000}))
    assert sorted(p.split(":")[0] for p in found) == ["interval_s", "listen.port"]


def test_argv_as_a_string_is_refused(tmp_path: Path) -> None:
    data = minimal()
    data["runtime"]["instances"][0]["argv"] = "vllm serve model --port 8000"
    (problem,) = problems(tmp_path, data)
    assert problem.startswith("runtime.instances.0.argv: argv must be a list of arguments")


def test_argv_that_is_not_vllm_is_refused(tmp_path: Path) -> None:
    data = minimal()
    data["runtime"]["instances"][0]["argv"] = ["bash", "-c", "vllm serve m"]
    (problem,) = problems(tmp_path, data)
    assert "argv must start a vLLM server" in problem


@pytest.mark.parametrize(
    ("extra", "url"),
    [
        ([], "http://127.0.0.1:8000"),
        (["--port", "8123"], "http://127.0.0.1:8123"),
        (["--port=8124", "--host=0.0.0.0"], "http://127.0.0.1:8124"),
        (["--host", "10.1.2.3", "--port", "9"], "http://10.1.2.3:9"),
        (["--host", "::1"], "http://[::1]:8000"),
    ],
)
def test_instance_url_from_argv(extra: list[str], url: str) -> None:
    assert InstanceConfig(name="a", argv=(*MODULE_ARGV, *extra)).url == url


def test_duplicate_instances_and_port_clashes_are_refused(tmp_path: Path) -> None:
    instances = [
        {"name": "a", "argv": MODULE_ARGV, "kvpool_port": 9500},
        {"name": "a", "argv": [*MODULE_ARGV, "--port", "8001"]},
    ]
    (problem,) = problems(tmp_path, minimal(runtime={"kind": "local", "instances": instances}))
    assert problem == "runtime: instance name 'a' appears twice"
    instances[1]["name"] = "b"
    instances[1]["kvpool_port"] = 8000  # instance a's server port
    (problem,) = problems(tmp_path, minimal(runtime={"kind": "local", "instances": instances}))
    assert problem == "runtime: kvpool_port 8000 is also a server's --port"


def test_process_runtime(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, {"runtime": {"kind": "process", "port": 8000, "cmdline_regex": "tiny"}})
    )
    assert isinstance(config.runtime, ProcessRuntimeConfig)
    assert config.runtime.url == "http://127.0.0.1:8000"
    (problem,) = problems(
        tmp_path, {"runtime": {"kind": "process", "port": 1, "cmdline_regex": "("}}
    )
    assert problem.startswith("runtime.cmdline_regex: not a regular expression")


def test_unknown_runtime_kind(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, {"runtime": {"kind": "kubernetes"}})
    assert problem.startswith("runtime: Input tag 'kubernetes'")


def test_notifier_names_default_to_kind_and_must_be_unique(tmp_path: Path) -> None:
    hook = {"kind": "webhook", "url": "http://h/x"}
    config = load_config(write(tmp_path, minimal(notifiers=[hook])))
    assert config.notifiers[0].name == "webhook"
    (problem,) = problems(tmp_path, minimal(notifiers=[hook, hook]))
    assert problem == "(top level): notifier name 'webhook' appears twice"


def test_notifier_repeat_defaults_differ_by_kind() -> None:
    config = AgentConfig.model_validate(
        minimal(
            notifiers=[
                {"kind": "webhook", "url": "http://h/x"},
                {"kind": "alertmanager", "url": "http://am:9093"},
            ]
        )
    )
    assert config.notifiers[0].repeat_interval_s > config.notifiers[1].repeat_interval_s


# -- environment overrides -------------------------------------------------------------------


def test_env_overrides_nested_fields_as_yaml(tmp_path: Path) -> None:
    env = {
        "KVPILOT_LISTEN__PORT": "9500",
        "KVPILOT_REMEDIATION__DRY_RUN": "true",
        "KVPILOT_REMEDIATION__BUDGET__MAX_RESTARTS": "1",
        "KVPILOT_INTERVAL_S": "2.5",
        "KVPILOT_RULES__PREEMPTION_SPIKE__ACTION": "restart",
        "KVPILOT_RUNTIME__INSTANCES__0__KVPOOL_PORT": "9600",
    }
    config = load_config(write(tmp_path, minimal()), env)
    assert config.listen.port == 9500
    assert config.remediation.dry_run is True
    assert config.remediation.budget.max_restarts == 1
    assert config.interval_s == 2.5
    assert config.rules.preemption_spike.action == "restart"
    assert isinstance(config.runtime, LocalRuntimeConfig)
    assert config.runtime.instances[0].kvpool_port == 9600


def test_env_text_fields_keep_the_raw_string(tmp_path: Path) -> None:
    env = {"KVPILOT_API__TOKEN": "0123", "KVPILOT_RUNTIME__API_KEY": "true"}
    config = load_config(write(tmp_path, minimal()), env)
    assert config.api.token is not None and config.api.token.get_secret_value() == "0123"
    assert config.runtime.api_key is not None
    assert config.runtime.api_key.get_secret_value() == "true"


def test_env_alone_can_configure_the_agent() -> None:
    config = load_config(None, {"KVPILOT_RUNTIME__KIND": "process", "KVPILOT_RUNTIME__PORT": "8"})
    assert isinstance(config.runtime, ProcessRuntimeConfig)
    assert config.runtime.port == 8


def test_other_kvpilot_variables_are_left_alone(tmp_path: Path) -> None:
    env = {"KVPILOT_KVPOOL_PORT": "9500", "KVPILOT_VLLM_URL": "http://x", "PATH": "/bin"}
    assert load_config(write(tmp_path, minimal()), env) == load_config(write(tmp_path, minimal()))


def test_env_error_names_the_variable(tmp_path: Path) -> None:
    found = problems(tmp_path, minimal(), {"KVPILOT_LISTEN__PORT": "nine"})
    assert len(found) == 1
    assert found[0].startswith("listen.port: Input should be a valid integer")
    assert found[0].endswith("[from KVPILOT_LISTEN__PORT]")


def test_env_typo_suggests(tmp_path: Path) -> None:
    found = problems(tmp_path, minimal(), {"KVPILOT_REMEDIATON__DRY_RUN": "true"})
    assert found == [
        "KVPILOT_REMEDIATON__DRY_RUN: remediaton: unknown field; did you mean 'remediation'?"
    ]


# -- files and secrets ---------------------------------------------------------------------


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "listen: [1, 2"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    config = load_config(write(tmp_path, minimal(api={"token_file": str(token_file)})))
    token = config.api.control_token()
    assert token is not None and token.get_secret_value() == "s3cret-token"
    token_file.write_text("")
    with pytest.raises(ConfigError, match=r"api.token_file: .* is empty"):
        config.api.control_token()
    (problem,) = problems(tmp_path, minimal(api={"token": "t", "token_file": str(token_file)}))
    assert problem == "api: set token or token_file, not both"


SECRETS = {
    "token": "tok-AAAA1111",
    "hmac": "hmac-BBBB2222",
    "slack": "https://hooks.slack.com/services/T000/B000/SLACKCCCC3333",
    "header": "Bearer HDR-DDDD4444",
    "vllm": "vllm-EEEE5555",
    "password": "pw-FFFF6666",
}


def secret_config() -> dict[str, Any]:
    data = minimal(
        api={"token": SECRETS["token"]},
        notifiers=[
            {
                "kind": "webhook",
                "url": "https://user:pw@recv.example/hook?key=q",
                "hmac_secret": SECRETS["hmac"],
                "headers": {"Authorization": SECRETS["header"]},
            },
            {"kind": "slack", "url": SECRETS["slack"]},
            {
                "kind": "alertmanager",
                "url": "http://am:9093",
                "auth": {"username": "kv", "password": SECRETS["password"]},
            },
        ],
    )
    data["runtime"]["api_key"] = SECRETS["vllm"]
    return data


def test_secrets_never_show_in_repr_or_errors(tmp_path: Path) -> None:
    config = AgentConfig.model_validate(secret_config())
    text = repr(config) + str(config)
    assert not [name for name, value in SECRETS.items() if value in text]
    bad = secret_config()
    bad["notifiers"][0]["hmac_secret"] = 12345678  # not a string: an error, value hidden
    bad["api"]["token"] = ["tok-AAAA1111"]
    found = "\n".join(problems(tmp_path, bad))
    assert "notifiers.0.hmac_secret" in found and "api.token" in found
    assert "12345678" not in found and SECRETS["token"] not in found


LEAKED = "Hunter2-pw"  # a password an attacker looks for in what the loader prints
RUNTIME_YAML = "runtime: {kind: local, instances: [{name: a, argv: [vllm, serve, m]}]}\n"


@pytest.mark.parametrize(
    ("text", "environ", "says"),
    [
        # PyYAML quotes the line it stops at: the line holds the URL with its password.
        (f"notifiers: [{{kind: webhook, url: 'http://u:{LEAKED}@h/x}}]\n", {}, "line 1"),
        (f"api:\n\ttoken: {LEAKED}\n", {}, "line 2, column 1"),
        # A wrong value is shown as given: a URL's user-info is masked in it.
        (
            RUNTIME_YAML + f"notifiers: [{{kind: webhook, url: 'ftp://u:{LEAKED}@h/x'}}]\n",
            {},
            "(got 'ftp://***@h/x')",
        ),
        (RUNTIME_YAML, {"KVPILOT_INTERVAL_S": f"http://u:{LEAKED}@h/"}, "http://***@h/"),
        (RUNTIME_YAML, {"KVPILOT_NOTIFIERS": f"[{{url: 'http://u:{LEAKED}@h/'"}, "line 1"),
        # A secret whose type is wrong (a number) is not shown where its place says secret.
        (
            "runtime: {kind: local, instances: [{name: a, argv: [vllm, --api-key, 12345678]}]}",
            {},
            "argv.2: Input should be a valid string",
        ),
        (RUNTIME_YAML.replace("m]}", "m], env: {HF_TOKEN: 12345678}}"), {}, "env.HF_TOKEN"),
    ],
)
def test_errors_never_echo_a_password_from_the_input(
    tmp_path: Path, text: str, environ: dict[str, str], says: str
) -> None:
    found = "\n".join(problems(tmp_path, text, environ))
    assert says in found
    assert LEAKED not in found and "12345678" not in found, found


def test_config_check_prints_a_yaml_error_without_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, f"notifiers:\n  - url: http://u:{LEAKED}@h/x: [\n")
    result = run_cli("config", "check", str(path), "--no-env")
    assert result.exit_code == 2
    assert "mapping values are not allowed here at line 2" in result.output
    assert LEAKED not in result.output


def run_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """kvpilot."""

    config_cli.register(app)
    return CliRunner().invoke(app, list(args), env=env)


def test_config_check_ok_summarises_with_secrets_masked(tmp_path: Path) -> None:
    result = run_cli("config", "check", str(write(tmp_path, secret_config())), "--no-env")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK: ")
    assert "runtime: local, 1 instance(s)" in result.output
    assert "webhook -> https://***@recv.example/hook?key=***" in result.output
    assert "slack -> https://hooks.slack.com/***" in result.output
    assert "preemption_spike (ladder)" in result.output
    assert not [name for name, value in SECRETS.items() if value in result.output]


def test_config_check_errors_exit_2(tmp_path: Path) -> None:
    result = run_cli("config", "check", str(write(tmp_path, minimal(remediaton={}))), "--no-env")
    assert result.exit_code == 2
    assert "remediaton: unknown field; did you mean 'remediation'?" in result.output


def test_config_check_applies_environment(tmp_path: Path) -> None:
    path = str(write(tmp_path, minimal()))
    result = run_cli("config", "check", path, env={"KVPILOT_LISTEN__PORT": "0"})
    assert result.exit_code == 2
    assert "listen.port" in result.output and "[from KVPILOT_LISTEN__PORT]" in result.output


def test_light_step_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, minimal(remediation={"light_step_reset_prefix_cache": True}))
    with caplog.at_level(logging.WARNING, logger="kvpilot.agent.config"):
        load_config(path)
    assert any("unauthenticated" in r.getMessage() for r in caplog.records)
    result = run_cli("config", "check", str(path), "--no-env")
    assert result.exit_code == 0
    assert "warning: remediation.light_step_reset_prefix_cache" in result.output


def test_committed_schema_matches_the_models() -> None:
    committed = json.loads(SCHEMA.read_text())
    assert committed == config_cli.json_schema(), (
        "docs/kvpilot.schema.json is stale: run `kvpilot config schema > docs/kvpilot.schema.json`"
    )


def test_schema_command_prints_the_schema() -> None:
    result = run_cli("config", "schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(AgentConfig.model_fields)


def test_editors_schema_accepts_the_example_and_flags_a_typo() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    example = yaml.safe_load(EXAMPLE.read_text())
    jsonschema.Draft202012Validator(schema).validate(example)
    errors = list(
        jsonschema.Draft202012Validator(schema).iter_errors({**example, "remediaton": {}})
    )
    assert [e.validator for e in errors] == ["additionalProperties"]
