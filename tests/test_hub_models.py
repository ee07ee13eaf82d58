"""Models by Hugging Face Hub id, resolved through ``huggingface_hub`` from a real cache layout that the test
builds from the default model's files (``models--org--name/`` with ``refs/``, ``snapshots/<commit>/`` and
``blobs/``), offline (``HF_HUB_OFFLINE=1``): the same greedy text as the model's directory, revisions by
branch, tag and commit, GGUF repositories by file name and by vLLM's ``:QUANT`` form, the served name, and
errors that name the id, the cache and the variables. No mock server."""

from __future__ import annotations

import hashlib
import os

import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.weights import resolve_model_dir
from rawpaged.weights.hub import hub_cache_dir, is_repo_id

pytestmark = pytest.mark.model

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_REPO = "rawpaged-tests/SmolLM2-135M-Instruct-GGUF"
COMMIT = "a" * 40
OLD_COMMIT = "b" * 40
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_snapshot(cache, repo: str, commit: str, files: dict, refs=("main",)) -> None:
    """``files`` (name in the repo -> local file) as the library lays out a download: each a symlink
    ``snapshots/<commit>/<name>`` -> ``../../blobs/<hash>``, the blob a link to the file; ``refs/<ref>``
    holding the commit."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to(src.resolve())
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub(model_dir, tmp_path_factory):
    """An HF_HOME whose hub cache holds the default model as REPO (main and tag v1 at COMMIT, an older
    commit without a tokenizer) and its Q4_1 GGUF as GGUF_REPO."""
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    files = {p.name: p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")}
    add_snapshot(cache, REPO, COMMIT, files, refs=("main", "v1"))
    add_snapshot(cache, REPO, OLD_COMMIT, {"config.json": model_dir / "config.json"}, refs=("old",))
    add_snapshot(cache, GGUF_REPO, COMMIT, {GGUF: model_dir / GGUF, "README.md": model_dir / "config.json"})
    return home


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_ids_and_paths_are_told_apart(tmp_path):
    assert is_repo_id(REPO) and is_repo_id(GGUF_REPO + ":Q4_1")
    assert not is_repo_id("SmolLM2-135M-Instruct") and not is_repo_id("/abs/path") and not is_repo_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id(str(tmp_path / "org" / "name"))


def test_a_hub_id_generates_what_its_directory_does(offline, model_dir):
    assert hub_cache_dir() == offline / "hub"
    snap = resolve_model_dir(REPO)
    assert snap == offline / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / COMMIT
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = "The capital of France is"
    by_id = LLM(model=REPO, num_kv_blocks=64, max_model_len=512).generate([prompt], params)[0].outputs[0].text
    by_dir = (
        LLM(model=str(model_dir), num_kv_blocks=64, max_model_len=512).generate([prompt], params)[0].outputs[0].text
    )
    assert by_id == by_dir and by_id


def test_revisions_by_branch_tag_and_commit(offline):
    assert resolve_model_dir(REPO, revision="v1").name == COMMIT
    assert resolve_model_dir(REPO, revision=COMMIT).name == COMMIT
    with pytest.raises(ValueError, match="no config.json|not in the Hugging Face cache"):
        resolve_model_dir(REPO, revision="missing-branch")


def test_gguf_repositories_by_file_and_by_quant(offline, model_dir):
    by_file = resolve_model_dir(GGUF_REPO, gguf_file=GGUF)
    by_quant = resolve_model_dir(GGUF_REPO + ":q4_1")
    assert by_file == by_quant and by_file.name == GGUF and by_file.resolve() == (model_dir / GGUF).resolve()
    with pytest.raises(ValueError, match="must match exactly one .gguf file"):
        resolve_model_dir(GGUF_REPO + ":Q8_0")
    llm = LLM(model=GGUF_REPO + ":Q4_1", num_kv_blocks=64, max_model_len=512)
    assert llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_a_missing_model_names_the_id_the_cache_and_the_variables(offline):
    with pytest.raises(ValueError) as e:
        resolve_model_dir("someone/not-downloaded")
    message = str(e.value)
    assert "'someone/not-downloaded'" in message and str(offline / "hub") in message
    assert "HF_HUB_OFFLINE" in message and "HF_HOME" in message


def test_the_server_takes_the_id_as_its_first_argument_and_serves_it_by_name(offline):
    from rawpaged.config import EngineConfig
    from rawpaged.entrypoints.api_server import model_name_of
    from rawpaged.entrypoints.cli import build_serve_parser, engine_config_from_args

    args = build_serve_parser().parse_args([REPO, "--revision", "v1"])
    assert args.model_tag == REPO
    args.model = args.model_tag
    config = engine_config_from_args(args)
    assert (config.model, config.revision) == (REPO, "v1")
    assert model_name_of(EngineConfig(model=REPO)) == REPO
