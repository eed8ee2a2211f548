"""TinyLlama's real config and a stand-in 500-id tokenizer written into an offline HF cache
(docs/upstream-engine-tests.md). ``python offline_tinyllama.py HF_HOME``."""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
VOCAB_SIZE = 500
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.35.0",
    "use_cache": True,
    "vocab_size": 32000,
}
SPECIAL = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
SENTENCES = [
    "A short word, a medium length word, and a much longer prompt with many tokens.",
    "Each word of the prompt is a token; short prompts have few tokens, long ones many.",
    "Hello world. This is a test prompt with several tokens and some extra tokens here.",
    "The model reads the prompt, one word after another word, and writes the next word.",
    "Hidden states are saved for every token of every request, short or long.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation: . , ; : ! ? ' \" ( ) [ ] - _ /",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Much more text makes the merges better: the, of, and, to, in, is, it, that, for, on.",
]


def train(work: Path) -> Path:
    """Train Llama's BPE shape on SENTENCES; returns the saved tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([])
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, min_frequency=1, show_progress=False
    )
    bpe.train_from_iterator(SENTENCES * 20 + [" ".join(["word"] * 50)], trainer=trainer)
    raw = work / "raw.json"
    bpe.save(str(raw))
    model = bpe.get_vocab()
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in _merges(raw)]
    tok = LlamaTokenizerFast(vocab=model, merges=merges, legacy=False, add_prefix_space=None)
    out = work / "tok"
    tok.save_pretrained(out)
    check(LlamaTokenizerFast.from_pretrained(out))
    return out


def _merges(raw: Path) -> list:
    return json.loads(raw.read_text())["model"]["merges"]


def check(tok) -> None:
    ids = tok(" ".join(["word"] * 500) + " extra tokens here é 漢字 🙂")["input_ids"]
    assert max(ids) < 1000 and len(tok) < 1000, (max(ids), len(tok))
    assert len(ids) < 600, f"'word' is not one token: {len(ids)} ids for 500 words"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2


def install(hf_home: Path) -> list[Path]:
    """Write config and tokenizer into ``hf_home`` and ``hf_home/hub`` in the hub's cache
    layout; returns the snapshot directories."""
    with tempfile.TemporaryDirectory() as tmp:
        src = train(Path(tmp))
        (src / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
        files = sorted(p for p in src.iterdir() if p.is_file())
        digest = hashlib.sha1()
        for p in files:
            digest.update(p.name.encode() + b"\0" + p.read_bytes())
        rev = digest.hexdigest()
        snaps = []
        for cache_dir in (hf_home, hf_home / "hub"):
            repo = cache_dir / f"models--{REPO.replace('/', '--')}"
            snap = repo / "snapshots" / rev
            snap.mkdir(parents=True, exist_ok=True)
            for p in files:
                (snap / p.name).write_bytes(p.read_bytes())
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(rev)
            snaps.append(snap)
    return snaps


if __name__ == "__main__":
    print(*install(Path(sys.argv[1])), sep="\n")
