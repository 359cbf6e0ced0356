"""Train deltaspec's shipped demonstration model: a small Qwen3.5-architecture model with one
MTP layer, on the Python standard library of the interpreter that runs this script.

    python bench/tools/train_default_model.py --out models/default [--minutes 6.5]

Corpus: every *.py under sysconfig's stdlib path (sorted; site-packages excluded), minus the
held-out modules in HELD_OUT (kept for evaluation and the acceptance benchmark), plus, with
--site-packages-mb, the first N MB of installed packages' sources. Tokenizer: an
8k byte-level BPE trained on the training split, with ChatML specials and template. Model:
GDN and gated attention 3:1 (HF `Qwen3_5ForCausalLM`), plus an MTP layer trained jointly:
    loss = CE(lm_head(h_t), x_{t+1}) + MTP_WEIGHT * CE(lm_head(mtp(embed(x_{t+1}), h_t)), x_{t+2})
with h_t the model's post-final-norm hidden state, as docs/design.md defines the MTP module. Trains in
bf16 autocast for a fixed wall-clock budget and writes an HF checkpoint (safetensors shards of at
most 12 MB, `mtp.*` in their own shard) that HF transformers loads (MTP aside) and deltaspec
serves, plus `training.json` with the held-out losses.

This is a training script, not part of the engine: it uses HF transformers on the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from tqdm import tqdm

# Modules and packages held out of training (evaluation + acceptance benchmark prompts).
HELD_OUT = ("argparse.py", "difflib.py", "heapq.py", "textwrap.py", "fractions.py", "json/", "csv.py",
            "statistics.py", "calendar.py", "shlex.py")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
VOCAB = 8192
SEQ_LEN, BATCH = 512, 64
MTP_WEIGHT = 0.3
MODEL = dict(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64, intermediate_size=1024, tie_word_embeddings=True, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def corpus_files(site_packages_bytes: int) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files). The standard library, minus HELD_OUT; optionally the
    first `site_packages_bytes` of installed packages' sources (sorted paths), because a stripped
    stdlib alone (2.7M tokens on the GPU image) is memorised within minutes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for p in files if any(str(p.relative_to(stdlib)).startswith(h) for h in HELD_OUT)]
    train = [p for p in files if p not in held]
    budget = site_packages_bytes
    for root in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        for path in sorted(Path(root).rglob("*.py")):
            if budget <= 0:
                break
            size = path.stat().st_size
            if size < 200_000:  # generated tables and vendored blobs teach little
                train.append(path)
                budget -= size
    return train, held


def read(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_all(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


class MTP(nn.Module):
    """fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]) -> one full-attention decoder layer -> norm."""

    def __init__(self, config, layer_class, norm_class) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=config.rms_norm_eps)
        attention_layer = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([layer_class(config, attention_layer)])
        self.norm = norm_class(hidden, eps=config.rms_norm_eps)

    def forward(self, embedded_next: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
        u = self.layers[0](u, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(u)


def losses(model, mtp: MTP, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (main loss, MTP loss, MTP top-1 agreement with the target token x_{t+2})."""
    out = model.model(input_ids=batch)
    hidden = out.last_hidden_state                                   # [B, T, H] post-norm
    logits = model.lm_head(hidden[:, :-1])
    main = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1).long())
    # Text positions as the multimodal rotary embedding takes them: [3 (t, h, w), B, T], all equal.
    positions = torch.arange(batch.shape[1] - 1, device=batch.device)[None, None].expand(3, batch.shape[0], -1)
    position_embeddings = model.model.rotary_emb(hidden, positions)
    drafted = mtp(model.model.embed_tokens(batch[:, 1:]), hidden[:, :-1], position_embeddings)
    mtp_logits = model.lm_head(drafted[:, :-1]).float()              # predicts x_{t+2}
    targets = batch[:, 2:].long()
    mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, VOCAB), targets.reshape(-1))
    agreement = (mtp_logits.argmax(-1) == targets).float().mean()
    return main, mtp_loss, agreement


@torch.no_grad()
def evaluate(model, mtp, data: torch.Tensor, device: str, batches: int = 16) -> dict:
    model.eval(), mtp.eval()
    totals = [0.0, 0.0, 0.0]
    generator = torch.Generator().manual_seed(0)
    for _ in range(batches):
        batch = sample_batch(data, generator).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            values = losses(model, mtp, batch)
        totals = [t + v.item() for t, v in zip(totals, values)]
    model.train(), mtp.train()
    return {"loss": totals[0] / batches, "mtp_loss": totals[1] / batches, "mtp_top1_accuracy": totals[2] / batches}


def sample_batch(data: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH,), generator=generator)
    return torch.stack([data[s:s + SEQ_LEN] for s in starts.tolist()])


def save(model, mtp: MTP, tokenizer: Tokenizer, out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.eos_token_id = tokenizer.token_to_id("<|im_end|>")
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    model.save_pretrained(out, safe_serialization=True, max_shard_size="12MB")
    mtp_tensors = {f"mtp.{name}": t.to(torch.bfloat16).contiguous().cpu() for name, t in mtp.state_dict().items()}
    save_file(mtp_tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        (out / "model.safetensors").rename(out / "model-main.safetensors")
        from safetensors import safe_open
        with safe_open(str(out / "model-main.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {name: "model-main.safetensors" for name in f.keys()}}
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp_tensors})
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    (out / "training.json").write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("models/default"))
    parser.add_argument("--minutes", type=float, default=6.5)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--site-packages-mb", type=float, default=0.0,
                        help="also train on this many MB of installed packages' Python sources")
    args = parser.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    started = time.time()
    random.seed(0), torch.manual_seed(0)
    train_files, held_files = corpus_files(int(args.site_packages_mb * 1e6))
    train_texts, held_texts = read(train_files), read(held_files)
    random.Random(0).shuffle(train_texts)
    tokenizer = train_tokenizer(train_texts[:3000])  # a sample is enough for an 8k vocabulary
    train, held = encode_all(tokenizer, train_texts), encode_all(tokenizer, held_texts)
    print(f"corpus: {len(train_files)} train files ({len(train)} tokens), {len(held_files)} held-out "
          f"({len(held)} tokens); tokenizer {time.time() - started:.0f}s")

    config = Qwen3_5TextConfig(**MODEL)
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).to(args.device)
    mtp = MTP(config, Qwen3_5DecoderLayer, Qwen3_5RMSNorm).to(args.device)
    num_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    parameters = list(model.parameters()) + list(mtp.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=args.device == "cuda")
    budget = args.minutes * 60
    generator = torch.Generator().manual_seed(1)
    step, tokens, train_start = 0, 0, time.time()
    bar = tqdm(total=int(budget), unit="s", desc="training")
    while (elapsed := time.time() - train_start) < budget:
        # Linear warm-up over 100 steps, then cosine decay over the wall-clock budget.
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(train, generator).to(args.device, non_blocking=True)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
            main_loss, mtp_loss, agreement = losses(model, mtp, batch)
        loss = main_loss + MTP_WEIGHT * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step, tokens = step + 1, tokens + batch.numel()
        if step % 25 == 0:
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}", acc=f"{agreement.item():.2f}")
        bar.update(int(time.time() - train_start) - bar.n)
    bar.close()
    train_seconds = time.time() - train_start
    held_out = evaluate(model, mtp, held, args.device)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "parameters": num_params, "steps": step,
              "tokens_seen": tokens, "train_minutes": train_seconds / 60, "total_minutes": (time.time() - started) / 60,
              "tokens_per_second": tokens / train_seconds, "held_out": held_out, "held_out_modules": list(HELD_OUT),
              "train_tokens": len(train), "held_out_tokens": len(held), "config": MODEL, "mtp_weight": MTP_WEIGHT,
              "lr": args.lr, "batch": [BATCH, SEQ_LEN], "train_files": len(train_files),
              "site_packages_mb": args.site_packages_mb, "command": "python bench/tools/train_default_model.py "
              f"--out {args.out} --minutes {args.minutes} --site-packages-mb {args.site_packages_mb}"}
    print(json.dumps(report, indent=1))
    save(model, mtp, tokenizer, args.out, report)


if __name__ == "__main__":
    main()
