"""Load and write HF-layout checkpoints of every registered family (config.json + safetensors,
optionally sharded): DeepSeek-V3 and GLM-4 MoE as released (MTP layers numbered after the target's,
routed experts as per-expert keys) and as HF's `save_pretrained` writes them.

Loading builds the model on the meta device and assigns each tensor straight from the memory-mapped
files, so at most one tensor is ever held twice (while it is converted). Released DeepSeek-V3 and
GLM-4.5 FP8 weights are e4m3 with 128x128 block scales (`*.weight_scale_inv`); they are dequantized here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .config import CheckpointError
from .family import CausalLM, FamilyConfig
from .registry import read_config

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Source:
    file: Path
    key: str


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_mtp: bool = True,
) -> CausalLM:
    """Load a checkpoint directory of any registered family. `with_mtp=False` skips the MTP layers
    (plain decoding)."""
    path = Path(path)
    family, cfg = read_config(path / "config.json")
    if with_mtp and cfg.num_nextn_predict_layers == 0:
        raise CheckpointError(
            f"{path / 'config.json'}: num_nextn_predict_layers is 0, so mtp_depth must be 0"
            " (this checkpoint has no MTP layers)"
        )
    if not with_mtp:
        cfg = replace(cfg, num_nextn_predict_layers=0)
    sources = _index(path)
    with torch.device("meta"):
        model = family.model(cfg)
    expected = _expected_keys(model)
    _check_keys(path, model, cfg, sources, expected)
    handles = _Handles()
    try:
        for name, param in list(model.state_dict(keep_vars=True).items()):
            target_dtype = _load_dtype(name, param, dtype)
            tensor = _materialize(name, param, expected[name], sources, handles, cfg, target_dtype, device)
            _assign(model, name, tensor)
    finally:
        handles.close()
    model.rope = model.make_rope().to(device)
    return model.eval()


def _load_dtype(name: str, param: Tensor, dtype: torch.dtype) -> torch.dtype:
    """Weights load in `dtype`; the routers' score biases in float32, integer tables (V4's
    tid2eid) as they are."""
    if not param.is_floating_point():
        return param.dtype
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def _index(path: Path) -> dict[str, _Source]:
    """checkpoint key -> (file, key), from the index when sharded, else from the files themselves."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        for file in set(weight_map.values()):
            if not (path / file).exists():
                raise CheckpointError(f"{index}: names shard {file!r}, which does not exist")
        return {k: _Source(path / f, k) for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    sources: dict[str, _Source] = {}
    for file in files:
        for key in _open(file).keys():
            sources[key] = _Source(file, key)
    return sources


def _open(file: Path) -> safe_open:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from None


class _Handles:
    """One open (memory-mapped) handle per shard for the duration of a load."""

    def __init__(self) -> None:
        self._open: dict[Path, safe_open] = {}

    def _slice(self, src: _Source, read: bool) -> Any:
        if src.file not in self._open:
            self._open[src.file] = _open(src.file)
        handle = self._open[src.file]
        try:
            return handle.get_tensor(src.key) if read else handle.get_slice(src.key).get_shape()
        except (SafetensorError, OSError, ValueError) as e:  # e.g. the index names a key the shard lacks
            raise CheckpointError(f"{src.file}: cannot read key {src.key!r} ({e})") from None

    def get_tensor(self, src: _Source) -> Tensor:
        return self._slice(src, read=True)

    def shape(self, src: _Source) -> list[int]:
        return list(self._slice(src, read=False))

    def close(self) -> None:
        self._open.clear()


def _expected_keys(model: CausalLM) -> dict[str, list[str]]:
    """model parameter name -> the checkpoint keys it is built from (several for stacked experts)."""
    return {
        name: model.checkpoint_keys(name, param) for name, param in model.state_dict(keep_vars=True).items()
    }


def _check_keys(
    path: Path,
    model: CausalLM,
    cfg: FamilyConfig,
    sources: dict[str, _Source],
    expected: dict[str, list[str]],
) -> None:
    wanted = {k for keys in expected.values() for k in keys}
    mtp_keys = {k: model.mtp_key(k) for k in sources}
    if cfg.num_nextn_predict_layers and not any(mtp_keys.values()):
        raise CheckpointError(
            f"{path}: no MTP layer keys ({model.mtp_key_prefix(0)}*), though config.json has num_nextn_predict_layers "
            f"{cfg.num_nextn_predict_layers} (HF's save_pretrained writes none): serve it with mtp_depth 0"
        )
    for key in sorted(wanted):
        if key not in sources:
            raise CheckpointError(f"{path}: missing key {key!r}")
    for key, src in sources.items():
        if key in wanted or _allowed_extra(key, sources, model, cfg, mtp_keys[key]):
            continue
        raise CheckpointError(f"{src.file}: unexpected key {key!r}")


def _allowed_extra(
    key: str,
    sources: dict[str, _Source],
    model: CausalLM,
    cfg: FamilyConfig,
    mtp_key: tuple[int, str] | None,
) -> bool:
    if key.endswith("_scale_inv"):
        return key[: -len("_scale_inv")] in sources
    if mtp_key is None:
        return False
    layer, rest = mtp_key
    # MTP layers beyond the ones served (mtp_depth 0) are skipped, as are their shared copies.
    return layer >= cfg.num_nextn_predict_layers or rest in model.mtp_shared_copies()


def _materialize(
    name: str,
    param: Tensor,
    keys: list[str],
    sources: dict[str, _Source],
    handles: _Handles,
    cfg: FamilyConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Tensor:
    shape = list(param.shape[1:]) if len(keys) > 1 else list(param.shape)
    for key in keys:
        got = handles.shape(sources[key])
        if got != shape:
            raise CheckpointError(f"{sources[key].file}: key {key!r} has shape {got}, expected {shape}")
    if len(keys) == 1:
        return _read(keys[0], sources, handles, cfg).to(device=device, dtype=dtype)
    out = torch.empty(param.shape, dtype=dtype, device=device)
    for e, key in enumerate(keys):
        out[e].copy_(_read(key, sources, handles, cfg))
    return out


def _read(key: str, sources: dict[str, _Source], handles: _Handles, cfg: FamilyConfig) -> Tensor:
    tensor = handles.get_tensor(sources[key])
    if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor
    scale_key = key + "_scale_inv"
    if scale_key not in sources:
        raise CheckpointError(f"{sources[key].file}: FP8 key {key!r} has no {scale_key!r}")
    return dequantize_fp8(
        tensor, handles.get_tensor(sources[scale_key]), cfg.fp8_block_size or (128, 128), sources[scale_key]
    )


def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int], where: object = "") -> Tensor:
    """Block-scaled FP8 -> float32: every [block x block] tile is multiplied by its scale."""
    rows, cols = weight.shape
    br, bc = block
    want = [-(-rows // br), -(-cols // bc)]
    if list(scale_inv.shape) != want:
        raise CheckpointError(
            f"{getattr(where, 'file', where)}: scale {getattr(where, 'key', '')!r}"
            f" has shape {list(scale_inv.shape)}, expected {want}"
        )
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scale


def _assign(model: CausalLM, name: str, tensor: Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


def save_checkpoint(
    model: CausalLM, config: dict, path: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` in its family's released layout (`checkpoint_keys`: per-expert keys, the MTP
    layers where the family keeps them).

    `config` is the HF config.json dict the model was built from. The MTP layers get the shared-head
    and embedding copies that released checkpoints carry."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        keys = model.checkpoint_keys(name, tensor)
        keep = name.endswith("e_score_correction_bias") or not tensor.is_floating_point()
        t = tensor if dtype is None or keep else tensor.to(dtype)
        if len(keys) > 1:
            tensors |= {key: t[e].contiguous() for e, key in enumerate(keys)}
        else:
            tensors.setdefault(keys[0], t.contiguous())  # a tied head is its embedding, written once
    for i in range(model.cfg.num_nextn_predict_layers):
        for copy, source in model.mtp_shared_copies().items():
            tensors[model.mtp_key_prefix(i) + copy] = tensors[
                model.checkpoint_keys(source, state[source])[0]
            ].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
