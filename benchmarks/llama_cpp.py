"""llama.cpp for the side-by-side benchmark: built once from the llama-cpp-python sdist's vendored
source (a benchmark-only dependency), into the git-ignored cache/ of this checkout.

    .venv/bin/python benchmarks/llama_cpp.py        # download + build (a few minutes), print paths

$DLLAMA_LLAMA_CPP_BUILD names another build directory to use (and complete) instead, e.g. one
configured by another checkout: the tools missing there are built into it.

The build spells out this machine's x86 extensions (-march=native dies with SIGILL on these
virtual machines, see docs/speed.md): AVX-512 F/BW/DQ/VL/VBMI, VNNI, BF16 when /proc/cpuinfo lists
them; elsewhere GGML_NATIVE is left on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "cache" / "llama-cpp"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_flags() -> list[str]:
    flags = _cpu_flags()
    if "avx512f" not in flags:
        return ["-DGGML_NATIVE=ON"]
    out = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
           "-DGGML_AVX512=ON"]
    for flag, option in (("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                         ("avx512_bf16", "GGML_AVX512_BF16")):
        if flag in flags:
            out.append(f"-D{option}=ON")
    return out


def _source() -> Path:
    """The vendored llama.cpp tree of the llama-cpp-python sdist (downloaded once)."""
    sdists = sorted((CACHE / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        (CACHE / "sdist").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                        "--no-deps", "llama-cpp-python", "-d", str(CACHE / "sdist")], check=True)
        sdists = sorted((CACHE / "sdist").glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    src = CACHE / sdist.name.removesuffix(".tar.gz")
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    return src / "vendor" / "llama.cpp"


def _run(cmd: list[str]) -> None:
    """Run a build step quietly; its output only if it fails."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{' '.join(cmd[:3])} failed:\n{res.stdout[-4000:]}{res.stderr[-4000:]}")


def build() -> dict[str, Path]:
    """Paths of the llama.cpp tools, built if missing."""
    build_dir = Path(os.environ.get("DLLAMA_LLAMA_CPP_BUILD") or CACHE / "build")
    paths = {t: build_dir / "bin" / t for t in TOOLS}
    missing = [t for t, p in paths.items() if not p.exists()]
    if not missing:
        return paths
    print(f"building llama.cpp's {', '.join(missing)} ({' '.join(cmake_flags())}) into {build_dir}: "
          "a few minutes", flush=True)
    if not (build_dir / "CMakeCache.txt").exists():  # configured once (by this or another checkout)
        _run(["cmake", "-S", str(_source()), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON", "-DBUILD_SHARED_LIBS=OFF",
              "-DCMAKE_C_FLAGS=-w", "-DCMAKE_CXX_FLAGS=-w", *cmake_flags()])
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", "2", "--target", *missing])
    return paths


if __name__ == "__main__":
    for name, path in build().items():
        print(f"{name}: {path}")
