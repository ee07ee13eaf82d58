"""Models named by their Hugging Face Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``), as ``vllm serve
<id>`` takes them: resolved through ``huggingface_hub`` into its cache.

- With a network the files are downloaded (the library's progress bars), or found already there.
- Offline (``HF_HUB_OFFLINE=1``, or no network) the local cache is used: ``HF_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (the library's layout: ``models--org--name/``
  with ``refs/``, ``snapshots/<commit>/`` and ``blobs/``); ``revision`` picks a branch, tag or commit.
- GGUF repositories: ``gguf_file`` names the file, or vLLM's ``org/name:QUANT`` form picks the one
  ``.gguf`` file whose name holds ``QUANT`` (e.g. ``:Q4_K_M``).

Both the variables and the cache path are read when a model is resolved, not when the library is imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: ``org/name`` (letters, digits, ``-``, ``_``, ``.``), optionally ``:QUANT``
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$")
#: what a model snapshot needs: configs, tokenizer files, chat templates, weights
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]


def is_repo_id(model: str) -> bool:
    """Whether ``model`` reads as a Hub id (``org/name`` or ``org/name:QUANT``) and names no local path."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def hub_cache_dir() -> Path:
    """The cache ``huggingface_hub`` reads and writes, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _missing(model: str, revision: str | None, why: str) -> ValueError:
    cache = hub_cache_dir()
    where = f" at revision {revision!r}" if revision else ""
    mode = "HF_HUB_OFFLINE is set" if hub_offline() else "the Hub could not be reached or refused it"
    return ValueError(
        f"model {model!r}{where} is not in the Hugging Face cache at {cache} and {mode} ({why}); download it "
        "where there is a network (a first run without HF_HUB_OFFLINE does), or point HF_HOME or HF_HUB_CACHE "
        "at a cache that holds it"
    )


def resolve_repo(model: str, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """The local snapshot directory of the Hub id ``model`` (or, for a GGUF repository, the file), fetched
    if needed and allowed.

    Raises:
        ValueError naming the id, the cache path and the variables when it is not there and cannot be
        downloaded, when ``:QUANT`` matches no ``.gguf`` file or several, or for a bad revision.
    """
    from huggingface_hub import snapshot_download  # deferred: network library, only for Hub ids
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    repo_id, _, quant = model.partition(":")
    if quant and gguf_file:
        raise ValueError(f"model {model!r}: give the GGUF file as :QUANT or as gguf_file, not both")
    if gguf_file:
        patterns = [gguf_file]
    elif quant:
        patterns = sorted({f"*{q}*.gguf" for q in (quant, quant.upper(), quant.lower())})
    else:
        patterns = MODEL_PATTERNS
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                local_files_only=hub_offline(),
                allow_patterns=patterns,
            )
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise _missing(model, revision, type(e).__name__) from None
    except HFValidationError as e:
        raise ValueError(f"model {model!r}: {e}") from None
    if gguf_file:
        file = path / gguf_file
        if not file.is_file():
            raise _missing(f"{repo_id} (file {gguf_file})", revision, "no such file in the snapshot")
        return file
    if quant:
        found = sorted(p for p in path.rglob("*.gguf") if quant.lower() in p.name.lower())
        if len(found) != 1:
            names = [p.name for p in found] or "none"
            raise ValueError(f"model {model!r}: {quant!r} must match exactly one .gguf file; matched {names}")
        return found[0]
    if not (path / "config.json").is_file():
        raise _missing(model, revision, "the snapshot has no config.json")
    return path
