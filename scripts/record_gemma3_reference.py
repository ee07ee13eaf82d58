"""Record llama.cpp's greedy token ids on Gemma 3 270M's Q4_K_M GGUF (``python -m rawpaged.weights prepare
gemma-3-270m``) into ``tests/data/gemma3_270m_llama_cpp_greedy.json``, which
``tests/model_executor/test_gemma3_gguf.py::test_greedy_matches_llama_cpp`` compares our engine to.

    python scripts/record_gemma3_reference.py [--build-dir DIR] [--out FILE.json]

Run by hand, outside the test suite (a benchmark-time tool, never a dependency):

- llama.cpp is the tree vendored in the ``llama-cpp-python`` sdist (``pip download``), built here as shared
  libraries for this host (``-DGGML_NATIVE=ON``; with ``-mno-amx-*`` where /proc/cpuinfo lists AMX, which
  faults on some hosts), and driven through the sdist's own ctypes binding (``llama_cpp/llama_cpp.py``,
  loaded without the package's high-level modules and their dependencies).
- Each prompt is tokenized by llama.cpp (``llama_tokenize``, BOS added as the GGUF's ``add_bos_token``
  says, special-token text parsed), decoded in one batch, then 64 tokens are generated one at a time by
  llama.cpp's greedy sampler (``llama_sampler_init_greedy``: argmax; no temperature, no repetition
  penalty), the end-of-generation tokens included (the count is fixed: compare with ``ignore_eos``).
  At each step the gap between the two largest logits is recorded too, so a comparison can tell a near-tie.
- Eight prompts, two of them over 1,000 tokens, so the 512-token sliding window of five layers in six
  matters. The JSON names the llama.cpp version and commit, the CPU, the threads and the call sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import numpy as np
from gemma3_reference_files import LLAMA_CPP_REF as OUT
from gemma3_reference_files import ROOT

SDIST = "llama-cpp-python==0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"  # ggml-org/llama.cpp, as the sdist's CHANGELOG.md says for 0.3.36
N_NEW = 64
N_CTX = 4096
THREADS = 2


def long_prompts() -> list[str]:
    """Two prompts over 1,000 tokens: an essay-like text and Python code (written here, so the fixture
    needs no other file)."""
    topics = [
        ("rivers", "carry water from the mountains to the sea", "towns grew along their banks"),
        ("forests", "cover nearly a third of the land", "they shelter most of the animals on it"),
        ("deserts", "receive less than twenty-five centimetres of rain a year", "their nights are cold"),
        ("glaciers", "store most of the fresh water on Earth", "they move a few metres a day"),
        ("islands", "form where volcanoes rise from the ocean floor", "many have plants found nowhere else"),
        ("grasslands", "stretch across the middle of several continents", "large herds graze there"),
        ("wetlands", "filter water and slow floods", "birds stop there as they migrate"),
        ("mountains", "rise where the plates of the crust collide", "the air grows thin near their tops"),
        ("coral reefs", "grow in warm, shallow and clear seas", "a quarter of all sea life lives on them"),
        ("lakes", "fill basins carved by ice or by faults", "some are older than a million years"),
    ]
    paragraphs = []
    for i, (name, what, more) in enumerate(topics * 3):
        paragraphs.append(
            f"Chapter {i + 1}. The {name} of the world {what}. Scientists who study them note that {more}, "
            f"and that the {name} of each continent differ in size, age and history. In the year {1900 + 7 * i} "
            f"an expedition measured {3 + i} of them and wrote a report of {40 + 11 * i} pages."
        )
    essay = "\n\n".join(paragraphs) + "\n\nIn summary, the"
    funcs = []
    for i in range(24):
        funcs.append(
            textwrap.dedent(
                f'''
                def transform_{i}(values, factor={i + 2}):
                    """Scale each value by {i + 2}, add {i}, and keep those under {100 * (i + 1)}."""
                    out = []
                    for v in values:
                        w = v * factor + {i}
                        if w < {100 * (i + 1)}:
                            out.append(w)
                    return out
                '''
            )
        )
    code = "import math\n" + "".join(funcs) + "\n\ndef main():\n    data = list(range(50))\n"
    return [essay, code]


PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl named",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Water boils at a temperature of",
    "The three primary colors are",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    *long_prompts(),
]


def _has_amx() -> bool:
    try:
        return " amx" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cpu_name() -> str:
    """/proc/cpuinfo's model name, or the platform's processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(build_dir: Path) -> Path:
    """The extracted sdist (``llama_cpp/`` and ``vendor/llama.cpp/build/bin/libllama.so``), built if needed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(build_dir.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/libllama.so"))
    if found:
        return found[-1].parents[4]
    if not list(build_dir.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(build_dir)],
            check=True,
        )
    tarball = next(build_dir.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "xzf", tarball.name], cwd=build_dir, check=True)
    src = next(build_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    flags = ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"] if _has_amx() else []
    flags += [f.replace("_C_", "_CXX_") for f in flags]
    subprocess.run(
        ["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON"]
        + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"]
        + flags,
        cwd=src,
        check=True,
    )
    subprocess.run(["cmake", "--build", "build", "--target", "llama", "-j", "2"], cwd=src, check=True)
    return src.parents[1]


def binding(sdist: Path):
    """The sdist's ``llama_cpp.llama_cpp`` ctypes module on its own build's ``libllama.so`` (the package's
    ``__init__`` is skipped: it imports the high-level API and its extra dependencies)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(sdist / "vendor" / "llama.cpp" / "build" / "bin")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(sdist / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as lc  # noqa: PLC0415 (after the stub package)

    return lc


def generate(lc, model, vocab, prompt: str) -> dict:
    """llama.cpp's prompt ids, greedy ids and top-2 logit gaps for one prompt (a fresh context)."""
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    raw = prompt.encode("utf-8")
    buf = (lc.llama_token * (len(raw) + 8))()
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_bos, True)
    assert n > 0, n
    ids = list(buf[:n])
    params = lc.llama_context_default_params()
    params.n_ctx = N_CTX
    params.n_batch = N_CTX
    params.n_threads = THREADS
    params.n_threads_batch = THREADS
    ctx = lc.llama_init_from_model(model, params)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
    out, gaps = [], []
    batch_ids = (lc.llama_token * n)(*ids)
    batch = lc.llama_batch_get_one(batch_ids, n)
    for _ in range(N_NEW):
        assert lc.llama_decode(ctx, batch) == 0
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        top2 = np.sort(logits)[-2:]
        gaps.append(round(float(top2[1] - top2[0]), 4))
        tok = lc.llama_sampler_sample(chain, ctx, -1)
        assert tok == int(np.argmax(logits)), (tok, int(np.argmax(logits)))
        out.append(int(tok))
        one = (lc.llama_token * 1)(tok)
        batch = lc.llama_batch_get_one(one, 1)
    lc.llama_sampler_free(chain)
    lc.llama_free(ctx)
    return {"prompt": prompt, "prompt_ids": ids, "greedy_ids": out, "top2_gaps": gaps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--build-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "llama-build",
        help="where the sdist is built",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAWPAGED_WEIGHTS_DIR", str(ROOT / "weights"))
    sys.path.insert(0, str(ROOT))
    from rawpaged.weights import gemma3_gguf_path  # noqa: PLC0415 (after sys.path)

    gguf = gemma3_gguf_path()
    sdist = build(args.build_dir)
    lc = binding(sdist)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    vocab = lc.llama_model_get_vocab(model)
    cases = []
    for p in PROMPTS:
        cases.append(generate(lc, model, vocab, p))
        print(len(cases[-1]["prompt_ids"]), "prompt tokens ->", cases[-1]["greedy_ids"][:8], "...", flush=True)
    lc.llama_model_free(model)
    record = {
        "model": str(gguf.name),
        "llama_cpp": f"ggml-org/llama.cpp@{LLAMA_CPP_COMMIT} (vendored in {SDIST}), shared libraries, "
        f"GGML_NATIVE=ON{', -mno-amx-*' if _has_amx() else ''}",
        "system_info": lc.llama_print_system_info().decode().strip(),
        "cpu": cpu_name(),
        "threads": THREADS,
        "command": f"python scripts/record_gemma3_reference.py (llama_tokenize(add_special=add_bos, "
        f"parse_special=True); llama_decode of the prompt in one batch, n_ctx {N_CTX}; then {N_NEW} x "
        "llama_sampler_sample(greedy) + llama_decode of that token; EOS not stopping)",
        "n_new": N_NEW,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
