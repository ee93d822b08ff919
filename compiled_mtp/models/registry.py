"""The model families the engine serves, keyed by config.json's `model_type`. Adding a family is a
module in this package (config, attention, model; see family.py) and one line here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import CheckpointError, ModelConfig
from .deepseek_v3 import DeepseekV3
from .deepseek_v4 import DeepseekV4, DeepseekV4Config
from .family import Family
from .glm4_moe import Glm4Moe, Glm4MoeConfig

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "DeepSeek-V3",
            "deepseek_v3",
            ("DeepseekV3ForCausalLM",),
            ModelConfig,
            DeepseekV3,
            "DeepseekV3ForCausalLM",
        ),
        Family(
            "GLM-4 MoE", "glm4_moe", ("Glm4MoeForCausalLM",), Glm4MoeConfig, Glm4Moe, "Glm4MoeForCausalLM"
        ),
        Family(
            "DeepSeek-V4",
            "deepseek_v4",
            ("DeepseekV4ForCausalLM",),
            DeepseekV4Config,
            DeepseekV4,
            "DeepseekV4ForCausalLM",
            hf_mtp=False,  # HF's V4 drops the checkpoint's mtp.* layer
        ),
    )
}


def family_of(raw: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a config dict, by `model_type` and `architectures`; a CheckpointError names the
    field and the supported values."""
    family = FAMILIES.get(raw.get("model_type"))  # type: ignore[arg-type]
    if family is None:
        raise CheckpointError(
            f"{source}: model_type {raw.get('model_type')!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    archs = raw.get("architectures") or list(family.architectures)
    if not any(a in family.architectures for a in archs):
        raise CheckpointError(
            f"{source}: architectures {archs} not supported for "
            f"{family.model_type} (supported: {', '.join(family.architectures)})"
        )
    return family


def read_config(path: str | Path) -> tuple[Family, Any]:
    """(family, config) of a checkpoint's config.json."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found (a checkpoint directory needs config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    family = family_of(raw, str(path))
    return family, family.config.from_dict(raw, source=str(path))
