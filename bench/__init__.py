"""The benchmarks: each measures its subject against a baseline in the same run (SIMD against
scalar, layer-major against token by token, a run against a replay of its own reads) and returns
records; the CLI prints them. Only the CLI imports them (tests/test_layering.py)."""
from ds4f.bench.agent import bench_agent
from ds4f.bench.batch import bench_batch
from ds4f.bench.cache import bench_cache
from ds4f.bench.chat import bench_chat
from ds4f.bench.engine import bench_engine
from ds4f.bench.ggml import bench_ggml
from ds4f.bench.kernels import KERNELS as KERNEL_NAMES
from ds4f.bench.kernels import run_bench as run_kernel_bench
from ds4f.bench.prefill import bench_prefill
from ds4f.bench.spec import bench_spec
from ds4f.bench.spec_trained import bench_spec_trained
from ds4f.bench.split import bench_split
from ds4f.bench.structured import bench_structured

__all__ = ["bench_agent", "bench_batch", "bench_cache", "bench_chat", "bench_engine", "bench_ggml", "bench_prefill", "bench_spec", "bench_spec_trained", "bench_split", "bench_structured", "run_kernel_bench", "KERNEL_NAMES"]
