"""The memory planner: how much KV cache a model gets on a GPU, and why.

Pure Python and cheap to import: no numpy, torch or vLLM.
"""

from kvpilot.tuner.planner.calibration import (
    Calibration,
    LiveCacheConfig,
    calibrate,
    parse_cache_config_labels,
    predict_from_cache_config,
)
from kvpilot.tuner.planner.kv_sizing import KvCapacity, KvGeometry, kv_capacity, kv_geometry
from kvpilot.tuner.planner.model_shape import (
    AttentionKind,
    ModelShape,
    ModelShapeError,
    load_model_shape,
    shape_from_config,
)
from kvpilot.tuner.planner.plan import (
    FeasibleBounds,
    Plan,
    PlanError,
    PlanInputs,
    feasible_bounds,
    make_plan,
)
from kvpilot.tuner.planner.weights import WeightFormat, WeightMemory

__all__ = [
    "AttentionKind",
    "Calibration",
    "FeasibleBounds",
    "KvCapacity",
    "KvGeometry",
    "LiveCacheConfig",
    "ModelShape",
    "ModelShapeError",
    "Plan",
    "PlanError",
    "PlanInputs",
    "WeightFormat",
    "WeightMemory",
    "calibrate",
    "feasible_bounds",
    "kv_capacity",
    "kv_geometry",
    "load_model_shape",
    "make_plan",
    "parse_cache_config_labels",
    "predict_from_cache_config",
    "shape_from_config",
]
