"""Load and write checkpoints of every registered family (config.json + safetensors, optionally
sharded): DeepSeek-V3 and GLM-4 MoE as released (MTP layers numbered after the target's, routed
experts as per-expert keys) and as HF's `save_pretrained` writes them; DeepSeek-V4 as HF writes it
and as DeepSeek publishes it (the family's `KeyLayout`, told from the keys).

Loading builds the model on the meta device and assigns each tensor straight from the memory-mapped
files, so at most one tensor is ever held twice (while it is converted). Quantized weights are
dequantized here, each multiplied by its block scale (float32, or power-of-two float8_e8m0fnu):
FP8 (e4m3) with blocks of `quantization_config.weight_block_size` (DeepSeek-V3, GLM-4.5: scales
`*.weight_scale_inv`; DeepSeek-V4: `*.scale`), and DeepSeek-V4's FP4 experts, e2m1 values packed two
to a byte (low nibble first) in an int8 tensor [out, in / 2] with a scale per 32 inputs of a row.
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
from .family import CausalLM, FamilyConfig, KeyLayout
from .registry import read_config

INDEX_FILE = "model.safetensors.index.json"
_FP4_BLOCK = 32  # inputs of a row that share one FP4 scale
# e2m1 by code: sign bit 3, two exponent bits, one mantissa bit.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4_STORAGE = ("I8", "U8")  # the safetensors dtypes packed FP4 comes in


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
    layout = model.key_layout(sources)
    expected = _expected_keys(model, layout)
    _check_keys(path, model, cfg, layout, sources, expected)
    reader = _Reader(sources, cfg.fp8_block_size or (128, 128), layout)
    try:
        for name, param in list(model.state_dict(keep_vars=True).items()):
            target_dtype = _load_dtype(model, name, param, dtype)
            tensor = _materialize(param, expected[name], reader, target_dtype, device)
            _assign(model, name, tensor)
    finally:
        reader.close()
    model.rope = model.make_rope().to(device)
    return model.eval()


def _load_dtype(model: CausalLM, name: str, param: Tensor, dtype: torch.dtype) -> torch.dtype:
    """Weights load in `dtype`; those the family keeps in float32 (`float32_parameter`) in float32,
    integer tables (V4's tid2eid) as they are."""
    if not param.is_floating_point():
        return param.dtype
    return torch.float32 if model.float32_parameter(name) else dtype


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
            return handle.get_tensor(src.key) if read else handle.get_slice(src.key)
        except (SafetensorError, OSError, ValueError) as e:  # e.g. the index names a key the shard lacks
            raise CheckpointError(f"{src.file}: cannot read key {src.key!r} ({e})") from None

    def get_tensor(self, src: _Source) -> Tensor:
        return self._slice(src, read=True)

    def header(self, src: _Source) -> tuple[list[int], str]:
        """The stored shape and safetensors dtype ("F32", "F8_E4M3", "I8", ...), read from the header."""
        view = self._slice(src, read=False)
        return list(view.get_shape()), view.get_dtype()

    def close(self) -> None:
        self._open.clear()


class _Reader:
    """Reads checkpoint keys as tensors of their logical shape: FP8 and packed FP4 weights
    dequantized with the scales `layout` names."""

    def __init__(self, sources: dict[str, _Source], fp8_block: tuple[int, int], layout: KeyLayout) -> None:
        self.sources, self.fp8_block, self.layout = sources, fp8_block, layout
        self.handles = _Handles()

    def shape(self, key: str, floating: bool) -> tuple[list[int], bool]:
        """(the logical shape of `key`, whether it is packed FP4, two values to a stored byte)."""
        shape, dtype = self.handles.header(self.sources[key])
        if floating and dtype in _FP4_STORAGE and shape:
            return [*shape[:-1], 2 * shape[-1]], True
        return shape, False

    def read(self, key: str, floating: bool) -> Tensor:
        tensor = self.handles.get_tensor(self.sources[key])
        if tensor.dtype in _FP8:
            return self._dequantize(key, tensor.float(), self.fp8_block, "FP8")
        if floating and tensor.dtype in (torch.int8, torch.uint8):
            return self._dequantize(key, unpack_fp4(tensor), (1, _FP4_BLOCK), "FP4")
        return tensor

    def _dequantize(self, key: str, values: Tensor, block: tuple[int, int], kind: str) -> Tensor:
        scale_key = self.layout.scale_key(key)
        if scale_key not in self.sources:
            missing = "block scales" if scale_key is None else repr(scale_key)
            raise CheckpointError(f"{self.sources[key].file}: {kind} key {key!r} has no {missing}")
        src = self.sources[scale_key]
        return dequantize(values, self.handles.get_tensor(src), block, src)

    def close(self) -> None:
        self.handles.close()


def unpack_fp4(packed: Tensor) -> Tensor:
    """e2m1 codes two to a byte, the low nibble first -> float32 values, twice as many per row."""
    codes = packed.view(torch.uint8)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    return _E2M1[nibbles.long()]


def dequantize(values: Tensor, scale: Tensor, block: tuple[int, int], where: _Source) -> Tensor:
    """Decoded FP8 or FP4 values [rows, cols] -> float32, every [block] tile multiplied by its
    scale; a scale of the wrong shape, dtype or with a non-finite value is one error naming it."""
    rows, cols = values.shape
    br, bc = block
    want = [-(-rows // br), -(-cols // bc)]
    bad = f"{where.file}: scale {where.key!r}"
    if list(scale.shape) != want:
        raise CheckpointError(f"{bad} has shape {list(scale.shape)}, expected {want}")
    if not scale.is_floating_point() or scale.dtype in _FP8:
        raise CheckpointError(f"{bad} has dtype {scale.dtype}, expected float32 or float8_e8m0fnu")
    scale = scale.float()
    if not torch.isfinite(scale).all():
        raise CheckpointError(f"{bad} has non-finite values")
    return values * scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def _expected_keys(model: CausalLM, layout: KeyLayout) -> dict[str, list[str]]:
    """model parameter name -> the file's keys it is built from (several for stacked experts)."""
    return {
        name: [layout.key(k) for k in model.checkpoint_keys(name, param)]
        for name, param in model.state_dict(keep_vars=True).items()
    }


def _check_keys(
    path: Path,
    model: CausalLM,
    cfg: FamilyConfig,
    layout: KeyLayout,
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
    scales = {scale for k in sources if (scale := layout.scale_key(k)) is not None}
    for key, src in sources.items():
        if key in wanted or key in scales or layout.is_copy(key):
            continue
        if not _skipped_mtp_key(model, cfg, mtp_keys[key]):
            raise CheckpointError(f"{src.file}: unexpected key {key!r}")


def _skipped_mtp_key(model: CausalLM, cfg: FamilyConfig, mtp_key: tuple[int, str] | None) -> bool:
    if mtp_key is None:
        return False
    layer, rest = mtp_key
    # MTP layers beyond the ones served (mtp_depth 0) are skipped, as are their shared copies.
    return layer >= cfg.num_nextn_predict_layers or rest in model.mtp_shared_copies()


def _materialize(
    param: Tensor, keys: list[str], reader: _Reader, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    floating = param.is_floating_point()
    shape = list(param.shape[1:]) if len(keys) > 1 else list(param.shape)
    for key in keys:
        got, packed = reader.shape(key, floating)
        if got != shape:
            unpacked = " unpacked from FP4" if packed else ""
            raise CheckpointError(
                f"{reader.sources[key].file}: key {key!r} has shape {got}{unpacked}, expected {shape}"
            )
    if len(keys) == 1:
        return reader.read(keys[0], floating).to(device=device, dtype=dtype)
    out = torch.empty(param.shape, dtype=dtype, device=device)
    for e, key in enumerate(keys):
        out[e].copy_(reader.read(key, floating))
    return out


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
    layers where the family keeps them), in `dtype` if given, but for the parameters the family keeps in
    float32 (`float32_parameter`).

    `config` is the HF config.json dict the model was built from. The MTP layers get the shared-head
    and embedding copies that released checkpoints carry."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        keys = model.checkpoint_keys(name, tensor)
        keep = not tensor.is_floating_point() or model.float32_parameter(name)
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
