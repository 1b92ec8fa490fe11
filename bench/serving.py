"""SGLang 0.5.23's own load generator, ``sglang.bench_serving``, against ``kvstack serve``.

The acceptance test of the client-facing APIs (not part of the suite: it
installs SGLang into a cache folder of its own). It

1. installs ``sglang==0.5.23`` with ``--no-deps`` and the few modules
   ``sglang.bench_serving`` imports (``DEPS``) into ``--cache-dir``, once,
   with the project's pip; no CPU torchvision build matches the project's
   torch, so an import-only ``torchvision`` stand-in goes on the path of the
   bench_serving runs (only there);
2. starts ``kvstack serve --model-path smollm2`` (a private port, its own
   ready file), and stops and reaps it at the end, also on an error;
3. runs ``python -m sglang.bench_serving`` unmodified, once per backend
   (``sglang``: ``/generate``; ``sglang-oai``: ``/v1/completions``;
   ``sglang-oai-chat``: ``/v1/chat/completions``), with the real model's
   tokenizer (the converted checkpoint) and the ``random-ids`` dataset
   (random token ids: no download); small by default, for two CPU cores;
4. prints each run's table (bench_serving's own output) next to kvstack's
   retract counters scraped from ``/metrics`` before and after the run.

The last line is JSON, one object per backend: ``{"sglang": {"completed": N,
"failed": 0, ...}, "sglang-oai": {...}, "sglang-oai-chat": {...}}``, with
``failed`` = prompts sent - completed and the first few error messages.
Exit status 0 only if every backend completed every prompt.

    .venv/bin/python bench/serving.py                     # 16 prompts per backend
    .venv/bin/python bench/serving.py --num-prompts 32 --max-concurrency 8
    .venv/bin/python bench/serving.py --test-retract       # retracts forced every few passes
    .venv/bin/python bench/serving.py -- --max-total-tokens 4096   # flags for kvstack serve
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from serve_process import kvstack_serve

REPO = Path(__file__).resolve().parents[1]
SGLANG = "sglang==0.5.23"
# What sglang.bench_serving imports beyond the project's venv (torch, transformers,
# aiohttp, numpy, requests, tqdm...), found by trying; installed with --no-deps.
DEPS = (
    "msgspec",
    "orjson",
    "pybase64",
    "psutil",
    "triton",
    "starlette",
    "IPython",
    "traitlets",
    "datasets",
    "multiprocess",
    "dill",
    "xxhash",
    "pandas",
    "pyarrow",
    "apache-tvm-ffi",
    "sentencepiece",
    "compressed_tensors",
    "loguru",
)
BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
RETRACT_COUNTERS = (
    "sglang:num_retracted_requests_total",
    "sglang:num_retracted_input_tokens_total",
    "sglang:num_retracted_output_tokens_total",
    "kvstack_retracted_reqs_total",
    "kvstack_reprefilled_tokens_total",
)
SUMMARY_KEYS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_itl_ms",
    "median_e2e_latency_ms",
    "concurrency",
)

TORCHVISION_STUB = '''"""Import-only stand-in for torchvision, from kvstack's bench/serving.py.

sglang.bench_serving imports SGLang and transformers modules that import
torchvision (and its submodules) at module level and never call it on a
text-only run; no CPU torchvision build matches the project's torch. Every
``torchvision.*`` module imports, and every name in one is an empty class.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = __getattr__
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
'''


# -- SGLang, installed on the side --------------------------------------------------------


def install(cache: Path) -> str:
    """``PYTHONPATH`` for bench_serving: SGLang, its imports, the torchvision stand-in."""
    sglang, deps, stubs = cache / "sglang", cache / "deps", cache / "stubs"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
    if not (sglang / "sglang" / "bench_serving.py").exists():
        subprocess.run([*pip, str(sglang), SGLANG], check=True)
    missing = [d for d in DEPS if not (deps / f".{d}.installed").exists()]
    if missing:
        subprocess.run([*pip, str(deps), *missing], check=True)
        for dep in missing:
            (deps / f".{dep}.installed").touch()
    (stubs / "torchvision").mkdir(parents=True, exist_ok=True)
    (stubs / "torchvision" / "__init__.py").write_text(TORCHVISION_STUB)
    return os.pathsep.join(str(p) for p in (sglang, deps, stubs))


# -- kvstack serve --------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float | None]:
    """The retract counters in ``url``'s /metrics, summed over their series (None: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    found: dict[str, float | None] = dict.fromkeys(RETRACT_COUNTERS)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] = (found[sample.name] or 0.0) + sample.value
    return found


def moved(before: dict, after: dict) -> dict[str, float | None]:
    return {
        name: None if after[name] is None else after[name] - (before[name] or 0.0)
        for name in RETRACT_COUNTERS
    }


def served_model(url: str, fallback: str) -> str:
    """The model id ``/v1/models`` lists (what OpenAI-style requests name), else ``fallback``."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
            return json.loads(reply.read())["data"][0]["id"]
    except Exception:
        return fallback


# -- one bench_serving run --------------------------------------------------------------------


def bench(backend: str, url: str, model: str, tokenizer: Path, args, python_path: str, out: Path):
    """Run bench_serving for ``backend``; returns (its stdout, its result dict or None)."""
    result_file = out / f"{backend}.jsonl"
    command = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        backend,
        "--base-url",
        url,
        "--model",
        str(tokenizer),
        "--served-model-name",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        str(args.num_prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "0.5",
        "--request-rate",
        str(args.request_rate),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ready-check-timeout-sec",
        str(args.ready_check_timeout),
        "--seed",
        "1",
        "--disable-tqdm",
        "--output-file",
        str(result_file),
        "--output-details",
    ]
    env = {**os.environ, "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    run = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=out, timeout=args.timeout
    )
    text = run.stdout + run.stderr
    if not result_file.exists():
        return text, None
    return text, json.loads(result_file.read_text().splitlines()[-1])


def summary(result: dict | None, num_prompts: int, log: str) -> dict:
    if result is None:
        tail = [line for line in log.strip().splitlines() if line.strip()][-3:]
        return {"completed": 0, "failed": num_prompts, "errors": tail}
    out = {key: result[key] for key in SUMMARY_KEYS if key in result}
    out["failed"] = num_prompts - result.get("completed", 0)
    errors = sorted({e for e in result.get("errors", []) if e})
    if errors:
        out["errors"] = errors[:3]
    return out


def table_of(log: str) -> str:
    """bench_serving's result table (from its banner to its closing rule), else its tail."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if "Serving Benchmark Result" in line), None)
    if start is None:
        return "\n".join(lines[-25:])
    end = next((i for i in range(len(lines) - 1, start, -1) if lines[i].startswith("===")), None)
    return "\n".join(lines[start - 1 : (end or len(lines) - 1) + 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="smollm2", help="kvstack serve's --model-path")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--num-prompts", type=int, default=16, help="per backend")
    parser.add_argument("--input-len", type=int, default=64, help="random-input-len")
    parser.add_argument("--output-len", type=int, default=32, help="random-output-len")
    parser.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument(
        "--ready-check-timeout",
        type=int,
        default=60,
        help="bench_serving's wait for /v1/models (its default: 60 s)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per backend run")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "kvstack" / "sglang-0.5.23-bench",
        help="where SGLang and its imports are installed (once)",
    )
    parser.add_argument(
        "--test-retract",
        action="store_true",
        help="SGLang's SGLANG_TEST_RETRACT=1 for the stack: a retract every few forward "
        "passes, so every request is served through retracts and re-prefills",
    )
    parser.add_argument("serve_args", nargs="*", help="after --: more kvstack serve flags")
    args = parser.parse_args()

    from kvstack.model.paths import resolve_model_path

    checkpoint = resolve_model_path(args.model_path)
    python_path = install(args.cache_dir)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-serving-") as tmp:
        workdir = Path(tmp)
        env = {"SGLANG_TEST_RETRACT": "1"} if args.test_retract else {}
        flags = ["--model-path", args.model_path, *args.serve_args]
        with kvstack_serve(workdir, flags, timeout_s=600, env={**os.environ, **env}) as serve:
            url = serve.address
            model = served_model(url, args.model_path)
            print(f"kvstack serve at {url} (pid {serve.info['pid']}), model {model!r}", flush=True)
            for backend in args.backends:
                before = scrape(url)
                log, result = bench(backend, url, model, checkpoint, args, python_path, workdir)
                after = scrape(url)
                results[backend] = summary(result, args.num_prompts, log)
                retracts = moved(before, after)
                results[backend]["retracts"] = retracts
                print(f"\n### --backend {backend}\n{table_of(log)}")
                print("kvstack retract counters during the run (from /metrics):")
                for name, delta in retracts.items():
                    shown = "absent" if delta is None else f"{delta:g}"
                    print(f"  {name:<45} {shown:>10}")
                sys.stdout.flush()
    print(json.dumps(results))
    ok = all(r["failed"] == 0 and r.get("completed") == args.num_prompts for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
