"""A minimal, dependency-free reader and writer for the safetensors format (torch + numpy only).

File layout (https://github.com/huggingface/safetensors):

    [8 bytes]  N, little-endian u64: the length of the JSON header
    [N bytes]  JSON header, padded with spaces so that the data section starts on a multiple of 8:
               {"__metadata__": {"key": "value", ...},                  (optional, strings only)
                "name": {"dtype": "F32", "shape": [4, 3], "data_offsets": [begin, end]}, ...}
    [rest]     the data section: each tensor row-major and little-endian, at [begin, end) relative
               to the start of the section; the tensors cover the section exactly, without gaps.

`save` is deterministic: the same tensors and metadata always give the same bytes (tensors are laid
out in sorted name order, the JSON is compact with sorted keys inside every entry).
"""
import json
import os
import struct

import numpy as np
import torch

# safetensors dtype name -> (torch dtype, little-endian numpy dtype used for the bytes).
# BF16 has no numpy type: its bytes travel as int16 and are reinterpreted by torch.
_DTYPES = {
    "F64": (torch.float64, "<f8"),
    "F32": (torch.float32, "<f4"),
    "F16": (torch.float16, "<f2"),
    "BF16": (torch.bfloat16, "<i2"),
    "I64": (torch.int64, "<i8"),
    "I32": (torch.int32, "<i4"),
    "I16": (torch.int16, "<i2"),
    "I8": (torch.int8, "i1"),
    "U8": (torch.uint8, "u1"),
    "BOOL": (torch.bool, "?"),
}
_NAME_OF = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    np_dtype = _DTYPES[_NAME_OF[t.dtype]][1]
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16: copy the raw 16-bit patterns
    return np.ascontiguousarray(t.numpy()).astype(np_dtype, copy=False).tobytes()


def save(path, tensors, metadata=None):
    """Writes `tensors` (dict name -> torch.Tensor) and optional string `metadata` to `path`.

    Tensor names must not be "__metadata__"; metadata keys and values must be strings.
    """
    header = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot name a tensor")
        t = tensors[name]
        if t.dtype not in _NAME_OF:
            raise TypeError(f"tensor '{name}': dtype {t.dtype} is not supported")
        data = _tensor_bytes(t)
        header[name] = {
            "dtype": _NAME_OF[t.dtype],
            "shape": [int(d) for d in t.shape],
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


def load(path):
    """Reads `path`; returns (dict name -> torch.Tensor, metadata dict or {}).

    Validates the header length, each entry's dtype, shape and offsets, and that the tensors tile
    the data section exactly; raises ValueError naming the problem otherwise.
    """
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise ValueError(f"{path}: header length {n} is out of range")
    try:
        header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data = memoryview(blob)[8 + n :]
    metadata = header.pop("__metadata__", None) or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    tensors = {}
    ranges = []
    for name, entry in header.items():
        dtype_name = entry.get("dtype")
        if dtype_name not in _DTYPES:
            raise ValueError(f"{path}: tensor '{name}': unsupported dtype {dtype_name!r}")
        torch_dtype, np_dtype = _DTYPES[dtype_name]
        shape = entry.get("shape")
        begin, end = entry.get("data_offsets", (None, None))
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{path}: tensor '{name}': bad shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= len(data)):
            raise ValueError(f"{path}: tensor '{name}': bad data_offsets {entry.get('data_offsets')!r}")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != numel * np.dtype(np_dtype).itemsize:
            raise ValueError(f"{path}: tensor '{name}': size does not match dtype and shape")
        array = np.frombuffer(data[begin:end], dtype=np_dtype).reshape(shape).copy()
        t = torch.from_numpy(array)
        if dtype_name == "BF16":
            t = t.view(torch.bfloat16)
        tensors[name] = t.to(torch_dtype)
        ranges.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            raise ValueError(f"{path}: tensor '{name}' overlaps another or leaves a gap in the data section")
        covered = max(covered, end)
    if covered != len(data):
        raise ValueError(f"{path}: trailing bytes after the last tensor")
    return tensors, metadata
