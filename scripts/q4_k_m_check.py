"""Make a real Q4_K_M file of the default model with llama.cpp's ``llama-quantize`` and check that rawpaged,
computing on its blocks, decodes greedily as the same file dequantized to float32 does.

    python scripts/q4_k_m_check.py [--llama-quantize PATH] [--out FILE.json]

- ``llama-quantize``: the given binary, or one built from the llama.cpp sources vendored in the
  ``llama-cpp-python`` sdist (``pip download``; about 5 minutes on 2 cores, cached under
  ``--build-dir``). A benchmark-time tool, never a dependency.
- The Q4_K_M file is written beside the default model (``SmolLM2-135M-Instruct.Q4_K_M.gguf``) from its
  F32 GGUF: 576-wide rows are not a multiple of 256, so llama-quantize falls back there and the file holds
  Q5_0, Q4_K, Q6_K and Q8_0 tensors.
- The check: the recorded prompts (``tests/fixtures/reference_greedy.json``), greedy, through
  ``LLM(model=<file>)`` (native blocks) and through the file dequantized to float32 by the ``gguf``
  package (``convert_gguf_to_hf``, our float32 path), all six in one batch and each alone (decode at
  batch 1 and at batch 6 take different kernels). At each prompt's first differing token the float32
  model's logits decide, by the rule of the CUDA engine check (``check_cuda_engine.classify_divergences``):
  a near-tie or a divergence. Also: the bytes the model holds against the file's. An existing Q4_K_M file
  is reused (delete it to make it again).

Prints and writes JSON; exits 1 on a divergence that is not a near-tie, or on a float32 copy of a weight.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDIST = "llama-cpp-python==0.3.36"
Q4_K_M_NAME = "SmolLM2-135M-Instruct.Q4_K_M.gguf"


def build_llama_quantize(build_dir: Path) -> Path:
    """``llama-quantize`` built for this host (``GGML_NATIVE=ON``) from the sdist's vendored llama.cpp."""
    build_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(build_dir.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-quantize"))
    if found:
        return found[-1]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(build_dir)],
        check=True,
    )
    tarball = next(build_dir.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "xzf", tarball.name], cwd=build_dir, check=True)
    src = next(build_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    subprocess.run(
        ["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
        + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"],
        cwd=src,
        check=True,
    )
    subprocess.run(["cmake", "--build", "build", "--target", "llama-quantize", "-j", "2"], cwd=src, check=True)
    return src / "build" / "bin" / "llama-quantize"


def make_q4_k_m(llama_quantize: Path) -> Path:
    """The default model's Q4_K_M file (written once beside the model from its F32 GGUF)."""
    from rawpaged import weights as rp_weights

    f32 = rp_weights.default_f32_gguf_path()
    dest = f32.parent / Q4_K_M_NAME
    if dest.is_file():
        print(f"using the existing {dest} (delete it to quantize again)")
    else:
        subprocess.run([str(llama_quantize), str(f32), str(dest), "Q4_K_M", "2"], check=True)
    return dest


def check(path: Path) -> dict:
    import collections

    import gguf

    from rawpaged import LLM, SamplingParams
    from rawpaged import weights as rp_weights
    from rawpaged.testing.quant_blocks import weight_bytes
    from rawpaged.tools.check_cuda_engine import NEAR_TIE_RELATIVE, classify_divergences

    refs = json.loads((ROOT / "tests" / "fixtures" / "reference_greedy.json").read_text())["prompts"]
    prompts = [r["prompt_token_ids"] for r in refs]
    reader = gguf.GGUFReader(str(path))
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    file_tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    native = LLM(model=str(path), device="cpu", num_kv_blocks=256, max_model_len=1024)
    resident, dense = weight_bytes(native.engine.model)

    def greedy(llm, batched):
        if batched:
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = rp_weights.convert_gguf_to_hf(path, Path(tmp) / "hf", progress=False)
        dense_llm = LLM(model=str(hf), device="cpu", num_kv_blocks=256, max_model_len=1024)
        want = greedy(dense_llm, True)
        for name, batched in (("batched", True), ("alone", False)):
            got = greedy(native, batched)
            runs[name] = classify_divergences(dense_llm, prompts, want, got, NEAR_TIE_RELATIVE)
            runs[name]["divergences_at_1e-2"] = classify_divergences(dense_llm, prompts, want, got, 1e-2)["divergences"]
    return {
        "file": str(path),
        "tensor_types": dict(types),
        "file_tensor_bytes": file_tensor_bytes,
        "resident_weight_bytes": resident,
        "float32_weight_copies": [list(s) for s in dense if s[0] > 1 and s[1] > 1],
        "prompts": len(prompts),
        "tokens_per_prompt": 32,
        "near_tie_relative": NEAR_TIE_RELATIVE,
        "batched": runs["batched"],
        "alone": runs["alone"],
        "divergences": runs["batched"]["divergences"] + runs["alone"]["divergences"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-quantize", type=Path, help="a llama-quantize binary (default: build one)")
    p.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "llama-build")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "q4_k_m_check.json")
    args = p.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    tool = args.llama_quantize or build_llama_quantize(args.build_dir)
    result = check(make_q4_k_m(tool))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    brief = {k: v for k, v in result.items() if k not in ("batched", "alone")}
    for name in ("batched", "alone"):
        brief[name] = {k: v for k, v in result[name].items() if k != "per_prompt"}
    print(json.dumps(brief, indent=1))
    # the norms are 1-D; a 2-D float32 array would be a dequantized weight
    return 1 if result["divergences"] or result["float32_weight_copies"] else 0


if __name__ == "__main__":
    sys.exit(main())
