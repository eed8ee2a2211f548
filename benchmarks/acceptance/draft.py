"""Stage 3 (torch-2.11.0 environment + the speculators 0.9.0 layer): one EAGLE-3 draft
per dataset, with speculators' own model, data collation and loss, and its offline
top-1 agreement with the verifier on held-out prompts' right hidden states.

CPU training needs three settings of speculators' own: ``sdpa`` attention (flex
attention has no CPU backward), the eager KL loss (the default is a Triton kernel) and
a loop of our own around the model's forward, which returns the loss (its ``Trainer``
picks "cuda"). The draft layer is ``qwen3`` (vLLM maps only ``qwen3``/``llama`` drafts
to its EAGLE-3 models). ``python -m acceptance.draft ARGS.json`` prints
``ACCEPTANCE {json}``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import BaseDataset, CollateFn
from transformers import AutoConfig, Qwen3Config

DRAFT_AUX = [1, 2, 3]
TTT_STEPS = 3
MAX_LEN = 768  # tokens packed into one training step
PER_STEP = 8  # samples per step (about 700 tokens)


class Files(BaseDataset):
    """The extracted files as speculators' ``ArrowDataset`` hands them to training:
    aux layers flattened, the last layer's output as the verifier's last hidden state."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        super().__init__(MAX_LEN, hidden_states_dtype=torch.float32)

    def _compute_approx_lengths(self) -> list[int]:
        return [MAX_LEN // PER_STEP] * len(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def _get_raw_data(self, index: int) -> dict[str, torch.Tensor]:
        hs = load_file(str(self.files[index]))
        states = hs["hidden_states"].float()
        return {"hidden_states": states[:, :-1].flatten(1), "input_ids": hs["token_ids"],
                "verifier_last_hidden_states": states[:, -1],
                "loss_mask": torch.ones(len(hs["token_ids"]), dtype=torch.long)}  # fmt: skip


def build(verifier: Path) -> Eagle3DraftModel:
    """A one-layer ``qwen3`` EAGLE-3 draft of the verifier's width, its embeddings and
    LM head loaded from the verifier by speculators."""
    v = AutoConfig.from_pretrained(verifier)
    layer = Qwen3Config(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=512,
        num_hidden_layers=1, num_attention_heads=v.num_attention_heads,
        num_key_value_heads=v.num_key_value_heads, head_dim=v.head_dim,
        max_position_embeddings=v.max_position_embeddings, rms_norm_eps=v.rms_norm_eps,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Eagle3DraftModel.from_training_args(
        layer, draft_vocab_size=v.vocab_size, norm_before_residual=True, ttt_steps=TTT_STEPS,
        verifier_name_or_path=str(verifier), target_layer_ids=DRAFT_AUX, draft_attn_impl="sdpa",
    )  # fmt: skip
    if v.model_type == "qwen3_next":
        # Qwen3-Next's final norm is zero-centred (scale 1 + weight); speculators' qwen3
        # verifier_norm scales by weight: without this its targets are near uniform.
        with torch.no_grad():
            model.verifier_norm.weight += 1.0
    return model


def forward_args(batch: dict[str, Any]) -> dict[str, Any]:
    """The collated batch as the model's forward takes it."""
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
            "verifier_last_hidden_states")  # fmt: skip
    return {k: batch[k] for k in keys}


def finite_files(data: Path) -> list[Path]:
    """``data``'s files without a NaN or infinite value: a file with one turns the loss,
    and then every weight, into NaN (vLLM 0.24.0's wrong rows are other blocks' memory,
    which can hold any bytes), so a user's training would leave it out."""
    return [
        f
        for f in sorted(data.glob("*.safetensors"))
        if bool(load_file(str(f))["hidden_states"].float().isfinite().all())
    ]


def train(verifier: Path, data: Path, out: Path, steps: int, seed: int) -> dict[str, Any]:
    """Train a draft on ``data``'s finite files ``steps`` steps from ``seed``; save it to
    ``out``."""
    torch.manual_seed(seed)
    model = build(verifier).float().train()
    ds = Files(finite_files(data))
    collate = CollateFn(MAX_LEN, model.hidden_size, len(DRAFT_AUX), torch.float32, shift_batch)
    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    order = random.Random(seed)
    t0, loss = time.monotonic(), torch.tensor(0.0)
    for step in range(steps):
        batch = collate([ds[i] for i in order.sample(range(len(ds)), PER_STEP)])
        _, loss, _ = model(**forward_args(batch), ttt_steps=TTT_STEPS, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"draft {data.name} step {step} loss {loss.item():.3f}", file=sys.stderr,
                  flush=True)  # fmt: skip
    model.save_pretrained(out)
    left_out = len(list(data.glob("*.safetensors"))) - len(ds)
    return {"loss": float(loss.item()), "train_s": round(time.monotonic() - t0, 1),
            "files": len(ds), "nonfinite_files": left_out}  # fmt: skip


def top1(draft: Path, verifier: Path, heldout: Path) -> float:
    """How often the draft's first proposal is the verifier's greedy next token, given
    the verifier's right hidden states (the reference rows of held-out prompts)."""
    model = build(verifier)
    missing, unexpected = model.load_state_dict(load_file(str(draft / "model.safetensors")),
                                                strict=False)  # fmt: skip
    if unexpected or any(not k.startswith("verifier_") for k in missing):
        raise SystemExit(f"draft {draft}: missing {missing}, unexpected {unexpected}")
    model.float().eval()
    ds = Files(sorted(heldout.glob("*.safetensors")))
    collate = CollateFn(MAX_LEN, model.hidden_size, len(DRAFT_AUX), torch.float32, shift_batch)
    right = total = 0
    with torch.no_grad():
        for i in range(len(ds)):
            b = collate([ds[i]])
            n = int((b["document_ids"] >= 0).sum())
            args = forward_args(b)
            last = args.pop("verifier_last_hidden_states")
            # position j: the draft reads token j+1 and the rows of j, proposes token
            # j+2; the verifier's last hidden state at j+1 gives its greedy token j+2
            proposal = model(**args, ttt_steps=1)[0][0, :n]
            greedy = model.verifier_lm_head(model.verifier_norm(last)).argmax(-1)[0, :n]
            right += int((proposal == greedy).sum())
            total += n
    return right / max(total, 1)


def main() -> None:
    """Train a draft per dataset named in the arguments (skipping those already saved),
    then measure each one's offline top-1."""
    a = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(2)
    verifier, root = Path(a["verifier"]), Path(a["root"])
    result: dict[str, Any] = {}
    for name in a["datasets"]:
        out = root / "drafts" / name
        if not (out / "model.safetensors").exists():
            result[name] = train(verifier, root / "data" / name, out, a["steps"], a["seed"])
        top = top1(out, verifier, root / "data" / "heldout")
        result.setdefault(name, {})["top1"] = top
        print(f"draft {name}: offline top-1 {top:.3f}", file=sys.stderr, flush=True)
    print("ACCEPTANCE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
