"""A checkpoint directory's safetensors files as one index of tensor names: which file holds
each tensor, reading one tensor at a time (float8 ones from the file's bytes, which
safetensors' NumPy reader cannot type), and comparing two tensors a block at a time.
"""

from __future__ import annotations

import functools
import json
import os

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open


# safetensors' NumPy reader has no float8 type; these are read from the file's bytes.
FLOAT8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


@functools.lru_cache(maxsize=64)
def _safetensors_header(path: str, mtime_ns: int, size: int) -> tuple[dict, int]:
  """(header, offset of the data) of a safetensors file: 8-byte length, then JSON (cached per
  file version: `mtime_ns` and `size` are part of the key)."""
  del mtime_ns, size
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(header_len)), 8 + header_len


def _read_float8(path: str, name: str) -> np.ndarray:
  """One float8 tensor of a safetensors file, read from its bytes."""
  stat = os.stat(path)
  header, data_start = _safetensors_header(path, stat.st_mtime_ns, stat.st_size)
  entry = header[name]
  begin, end = entry["data_offsets"]
  with open(path, "rb") as f:
    f.seek(data_start + begin)
    data = f.read(end - begin)
  if len(data) != end - begin:
    raise OSError(f"tensor {name!r} ends past the end of the file")
  return np.frombuffer(data, FLOAT8_DTYPES[entry["dtype"]]).reshape(entry["shape"])


class SafetensorsIndex:
  """Tensor name -> file for `model.safetensors` or a sharded `model.safetensors.index.json`."""

  def __init__(self, model_dir: str):
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    single_path = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      files = {os.path.join(model_dir, fname) for fname in weight_map.values()}
      missing = sorted(p for p in files if not os.path.isfile(p))
      if missing:
        raise FileNotFoundError(f"weight files listed in {index_path} are missing: {missing}")
      self.file_of = {name: os.path.join(model_dir, fname) for name, fname in weight_map.items()}
    elif os.path.isfile(single_path):
      self.file_of = {name: single_path for name in self._keys(single_path)}
    else:
      raise FileNotFoundError(
          f"{model_dir!r} has no model.safetensors or model.safetensors.index.json")
    self._handles = {}

  @staticmethod
  def _keys(path):
    try:
      with safe_open(path, framework="numpy") as f:
        return list(f.keys())
    except (SafetensorError, OSError) as err:
      raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): "
                       f"{err}") from err

  @property
  def names(self) -> set[str]:
    return set(self.file_of)

  def read(self, name: str) -> np.ndarray:
    path = self.file_of[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="numpy")
    try:
      if self._handles[path].get_slice(name).get_dtype() in FLOAT8_DTYPES:
        return _read_float8(path, name)
      return self._handles[path].get_tensor(name)
    except (SafetensorError, OSError) as err:
      raise ValueError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): "
                       f"{err}") from err

  def _slice(self, name: str):
    path = self.file_of[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="numpy")
    return self._handles[path].get_slice(name)

  def same_bytes(self, a: str, b: str, chunk_bytes: int = 1 << 26) -> bool:
    """Whether tensors a and b hold the same shape, dtype and bytes, compared a block of rows
    at a time: the host holds two blocks, never two whole vocabulary tables."""
    if a not in self.file_of or b not in self.file_of:
      return False
    slice_a, slice_b = self._slice(a), self._slice(b)
    shape = tuple(slice_a.get_shape())
    if shape != tuple(slice_b.get_shape()) or slice_a.get_dtype() != slice_b.get_dtype():
      return False
    if not shape or not shape[0]:
      return self.read(a).tobytes() == self.read(b).tobytes()
    step = max(1, chunk_bytes // max(1, np.asarray(slice_a[0:1]).nbytes))
    for start in range(0, shape[0], step):
      rows = slice(start, min(shape[0], start + step))
      if np.asarray(slice_a[rows]).tobytes() != np.asarray(slice_b[rows]).tobytes():
        return False
    return True
