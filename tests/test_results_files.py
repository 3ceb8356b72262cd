"""The raw benchmark files stay small in a checkout: every tracked file under benchmarks/results
over RAW_LIMIT bytes is gzip-compressed (or an image, which compresses no further), so that the
working tree a GPU run copies does not grow by every suite log a benchmark keeps."""

import gzip
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
RAW_LIMIT = 32 * 1024
INCOMPRESSIBLE = (".png", ".gz")


def tracked_results() -> list[str]:
  """The files git tracks under RESULTS; outside a git checkout (an unpacked archive), every
  file there."""
  try:
    listed = subprocess.run(["git", "ls-files", RESULTS], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    listed = [os.path.join(RESULTS, name) for name in os.listdir(os.path.join(ROOT, RESULTS))]
  assert listed, f"no files under {RESULTS}"
  return [path for path in listed if os.path.isfile(os.path.join(ROOT, path))]


def oversized(paths: list[str], root: str = ROOT) -> list[str]:
  """The paths (under `root`) over RAW_LIMIT bytes that are neither gzip files nor images."""
  return [p for p in paths if not p.endswith(INCOMPRESSIBLE)
          and os.path.getsize(os.path.join(root, p)) > RAW_LIMIT]


def test_large_raw_files_are_compressed():
  assert oversized(tracked_results()) == []


def test_the_compressed_files_read_back():
  for path in tracked_results():
    if path.endswith(".gz"):
      with gzip.open(os.path.join(ROOT, path), "rb") as f:
        assert f.read(64), path


def test_the_check_sees_a_large_raw_file(tmp_path):
  (tmp_path / "big.log").write_text("x" * (RAW_LIMIT + 1))
  (tmp_path / "small.log").write_text("x" * 100)
  (tmp_path / "big.log.gz").write_bytes(gzip.compress(b"x" * (RAW_LIMIT + 1)) * 2000)
  assert (tmp_path / "big.log.gz").stat().st_size > RAW_LIMIT
  names = ["big.log", "small.log", "big.log.gz"]
  assert oversized(names, str(tmp_path)) == ["big.log"]
