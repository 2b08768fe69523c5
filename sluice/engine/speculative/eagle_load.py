"""Loading the self-drafting head of speculative_method="eagle".

A head file is a safetensors of the head's own tensors (sluice/models/eagle.py's
EAGLE_TENSORS) whose metadata says what it was trained for: the target's name, hidden
size and vocabulary, and the draft vocabulary (its first N ids) it learnt to pick
from. training/train_eagle.py writes them. sluice ships the heads it trained under
sluice/assets/eagle/ and picks the one made for the target when speculative_model is
not given. The head's embedding and output head are the target's own weights, the
same tensors the target loads (a quantized GGUF's blocks stay quantized), so the head
costs its file's size in memory plus the output rows it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sluice.architectures import spec_of
from sluice.config import EngineConfig, ModelConfig
from sluice.core.errors import ConfigError
from sluice.core.quantized_tensor import Weight, quantize_8bit
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.draft_load import draft_output_ids
from sluice.engine.speculative.eagle import EagleProposer
from sluice.engine.speculative.source import DraftBuild, DraftLoad
from sluice.runner.eagle_head import EAGLE_TENSORS, eagle_config, eagle_variant
from sluice.runner.factory import build_runner
from sluice.runner.kv_layout import kv_bytes_per_block

BUNDLED_DIR = Path(__file__).resolve().parents[2] / "assets" / "eagle"
FORMAT = "sluice-eagle-1"


@dataclass
class EagleModel:
    """A loaded, checked head whose runner is not built yet."""

    config: ModelConfig
    tensors: dict[str, Weight]
    output_ids: torch.Tensor | None
    path: Path

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.config, block_size, dtype)

    def cost_key(self) -> str | None:
        """The file's path, size and modification time (a retrained head is another key)."""
        st = self.path.stat()
        return f"{self.path}:{st.st_size}:{st.st_mtime_ns}"

    def build(self, ctx: DraftBuild) -> EagleProposer:
        """The head's runner (consuming its tensors) and KV pool, as a proposer. Its
        weights take the target's path (the quantization load chose them for)."""
        runner = build_runner(
            config=self.config,
            tensors=self.tensors,
            options=ctx.options,
            layout=ctx.layout.for_draft(ctx.layout.max_model_len),
            variant=eagle_variant(self.output_ids),
        )
        self.tensors = {}
        return EagleProposer(
            runner,
            KVCacheManager(
                ctx.layout.num_blocks, ctx.layout.block_size, enable_prefix_caching=False
            ),
            vocab_size=self.config.vocab_size,
            max_chunk_tokens=ctx.config.max_num_batched_tokens,
            output_ids=self.output_ids,
        )


def head_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def find_head(config: EngineConfig, target: ModelConfig) -> Path:
    """speculative_model, or the bundled head trained for this target."""
    if config.speculative_model is not None:
        path = Path(config.speculative_model).expanduser()
        if not path.is_file():
            raise ConfigError(
                "speculative_model",
                f"speculative_model {config.speculative_model!r}: no such EAGLE head file "
                "(a .safetensors written by training/train_eagle.py)",
            )
        return path
    for path in sorted(BUNDLED_DIR.glob("*.safetensors")):
        if head_metadata(path).get("target") == target.name:
            return path
    raise ConfigError(
        "speculative_model",
        f"speculative_method='eagle': no bundled EAGLE head for {target.name!r}; train "
        "one with training/train_eagle.py and pass it as speculative_model",
    )


def check_head(path: Path, meta: dict[str, str], target: ModelConfig) -> None:
    """The head must have been trained for this target: its features mean nothing to
    another model's."""
    if not spec_of(target.architecture).eagle_head or target.is_moe:
        raise ConfigError(
            "speculative_method",
            "speculative_method='eagle' runs on dense Llama-family targets",
        )
    want = {
        "format": FORMAT,
        "target": target.name,
        "hidden_size": str(target.hidden_size),
        "vocab_size": str(target.vocab_size),
    }
    for key, value in want.items():
        if meta.get(key) != value:
            raise ConfigError(
                "speculative_model",
                f"speculative_model {str(path)!r}: the EAGLE head's {key} is "
                f"{meta.get(key)!r}, the target's {value!r}",
            )


def load_eagle_head(ctx: DraftLoad) -> EagleModel:
    """The head for the target (checked), with the target's embedding and output head
    (called before the target's runner consumes the target's tensors).
    Where the target's weights stay block-quantized ("gguf"), the head's projections
    are quantized to 8 bits a value too: one decode row through a bfloat16 GEMM costs
    several times what the block kernel takes, and a draft is only a guess."""
    config, target, quantization = ctx.config, ctx.target, ctx.options.quantization
    path = find_head(config, target.config)
    meta = head_metadata(path)
    check_head(path, meta, target.config)
    tensors: dict[str, Weight] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in EAGLE_TENSORS:
            if name not in f.keys():
                raise ConfigError(
                    "speculative_model", f"speculative_model {str(path)!r} lacks tensor {name!r}"
                )
            tensor = f.get_tensor(name)
            blocks = quantization == "gguf" and tensor.dim() == 2 and tensor.shape[1] % 64 == 0
            tensors[name] = quantize_8bit(tensor) if blocks else tensor
    # The target's own embedding and head, shared with its loader (called before the
    # target's runner consumes them: the quantized blocks are one object for both).
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in target.tensors:
            tensors[name] = target.tensors[name]
    # The ids it learnt to pick from, fewer where speculative_draft_vocab_size says so.
    size = int(meta.get("draft_vocab_size", "0"))
    if config.speculative_draft_vocab_size and size:
        size = min(size, config.speculative_draft_vocab_size)
    output_ids = draft_output_ids(target.tokenizer, target.config.vocab_size, size)
    return EagleModel(eagle_config(target.config), tensors, output_ids, path)
