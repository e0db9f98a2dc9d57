"""Greedy generation with a KV cache, attention computed by exattn.

A small Llama-style causal LM is built from a config with random weights
fixed by a seed (no download). The prompt goes through `exattn.attention`
(causal), and every later step, one new token over the cache, through
`exattn.decode`. The tokens are compared with transformers' "eager" attention.

    pip install "exattn[hf]"
    python examples/generate_with_kv_cache.py --steps 32
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import exattn.integrations.transformers as exattn_hf  # registers attn_implementation="exattn"


def tiny_llama(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class CountDecodes:
    """Counts the calls the integration makes to `exattn.decode` while active."""

    def __enter__(self):
        self.calls, self.decode = 0, exattn_hf.decode

        def counted(*args, **kwargs):
            self.calls += 1
            return self.decode(*args, **kwargs)

        exattn_hf.decode = counted
        return self

    def __exit__(self, *exc):
        exattn_hf.decode = self.decode


def generate(model, implementation: str, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    model.set_attn_implementation(implementation)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[:, prompt.shape[1]:], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="new tokens to generate")
    parser.add_argument("--prompt-len", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = tiny_llama(args.seed)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    with CountDecodes() as decodes:
        ours, ours_s = generate(model, "exattn", prompt, args.steps)
    eager, eager_s = generate(model, "eager", prompt, args.steps)

    layers = model.config.num_hidden_layers
    print(f"prompt ({args.prompt_len} tokens): {prompt[0].tolist()}")
    print(f"exattn: {ours[0].tolist()}  ({ours_s:.2f} s)")
    print(f"eager:  {eager[0].tolist()}  ({eager_s:.2f} s)")
    print(f"identical tokens: {torch.equal(ours, eager)}")
    print(f"exattn.decode calls: {decodes.calls} ({args.steps - 1} cached steps x {layers} layers)")


if __name__ == "__main__":
    main()
