"""The whole configuration stays in composition (agent/app/parts.py, agent/app/compose.py):
elsewhere a function takes the section it reads, or a value composition builds (the tick's
`TickSettings`). The few that keep it read or check the configuration as a whole: loading it,
`config check`'s summary, its warnings, its secrets, the extras it needs, and the reload's
diff of the running configuration against the new one. Counted as scripts/house_figures.py
counts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# reload (3: its loader, the running configuration, the new one), config_warnings,
# secret_values, needed_extras, `config check`'s summary, and the per-Deployment settings
# laid over the whole (3: the merge, the Deployment's layer, the reload's layering step)
WHOLE_CONFIG_READERS = 10


def test_the_whole_configuration_stays_in_composition() -> None:
    spec = importlib.util.spec_from_file_location(
        "house_figures", ROOT / "scripts" / "house_figures.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # dataclasses look their module up while the class is made
    spec.loader.exec_module(script)
    found = script.figures(ROOT)
    outside = found.agent_config_params + found.agent_config_callables
    assert outside <= WHOLE_CONFIG_READERS
