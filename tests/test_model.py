"""The Llama-family model: packed documents, RoPE positions, Hugging Face checkpoints."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from attnpool.errors import ConfigError
from attnpool.parallel.checkpointing import apply_activation_checkpointing
from attnpool.model import (
    MODEL_PRESETS,
    ModelConfig,
    RopeScaling,
    Transformer,
    config_from_hf,
    load_hf_checkpoint,
    model_config,
    save_hf_checkpoint,
)

DOC_LENS = [5, 17, 1, 9]  # one packed batch: four documents of different lengths


# --- helpers ------------------------------------------------------------------


def packed_positions(doc_lens):
    """(doc id, position within the document) of every token of a packed batch."""
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])
    positions = torch.cat([torch.arange(n) for n in doc_lens])
    return doc_ids, positions


def dense_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(D)) v over the (query, key) pairs ``allowed`` (T_q, T_k); GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def document_attention(doc_ids):
    """Core attention for a packed batch: causal within each document, nothing across."""
    i = torch.arange(len(doc_ids))
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & (i[None, :] <= i[:, None])
    return lambda q, k, v, layer=None: dense_attention(q, k, v, allowed)


def assert_close_relative(actual, expected, tol=1e-5):
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} vs max value {scale:.3g}"


def randomize_(model, seed=0):
    """Weights large enough that attention is far from uniform, so a RoPE mistake shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def hf_logits_per_document(hf_model, tokens, doc_lens):
    """Hugging Face logits, running each document alone from position 0, concatenated."""
    outs = []
    with torch.no_grad():
        for doc in torch.split(tokens, doc_lens):
            outs.append(hf_model(input_ids=doc[None]).logits[0])
    return torch.cat(outs)


SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64)

HF_CASES = {
    "llama": ("LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3-rope-scaling": ("LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2-tied": ("Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
}


def make_hf_model(case):
    transformers = pytest.importorskip("transformers")
    arch, extra = HF_CASES[case]
    config_class = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    config = config_class(**SMALL, **extra, attn_implementation="eager")
    model = getattr(transformers, arch)(config).float().eval()
    return randomize_(model)


# --- Hugging Face equivalence ---------------------------------------------------


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_checkpoint_gives_same_logits_on_packed_documents(case, tmp_path):
    hf_model = make_hf_model(case)
    hf_model.save_pretrained(tmp_path)
    model, config = load_hf_checkpoint(tmp_path)
    assert config.tie_embeddings == (case == "qwen2-tied")
    assert config.qkv_bias == (case == "qwen2-tied")
    assert (config.rope_scaling is not None) == (case == "llama3-rope-scaling")

    doc_ids, positions = packed_positions(DOC_LENS)
    tokens = torch.randint(0, SMALL["vocab_size"], (len(doc_ids),), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens, positions, document_attention(doc_ids))
    assert logits.shape == (len(tokens), SMALL["vocab_size"])
    assert_close_relative(logits, hf_logits_per_document(hf_model, tokens, DOC_LENS))


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_hf_checkpoint(tmp_path)
    tokens = torch.arange(12) % SMALL["vocab_size"]
    with torch.no_grad():
        logits = model(tokens, torch.arange(12), document_attention(torch.zeros(12, dtype=torch.long)))
    assert_close_relative(logits, hf_logits_per_document(hf_model, tokens, [12]))


@pytest.mark.parametrize("tied,qkv_bias,scaled", [(False, False, False), (True, True, False), (False, False, True)])
def test_save_hf_checkpoint_loads_in_transformers(tied, qkv_bias, scaled, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                         tie_embeddings=tied, qkv_bias=qkv_bias, max_position=64,
                         rope_scaling=RopeScaling(original_max_position=16) if scaled else None)
    model = randomize_(Transformer(config)).eval()
    save_hf_checkpoint(model, config, tmp_path)

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert type(hf_model).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    doc_ids, positions = packed_positions(DOC_LENS)
    tokens = torch.randint(0, 97, (len(doc_ids),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(tokens, positions, document_attention(doc_ids))
    assert_close_relative(logits, hf_logits_per_document(hf_model, tokens, DOC_LENS))

    # And back: our own loader gives the same weights.
    reloaded, reloaded_config = load_hf_checkpoint(tmp_path)
    assert reloaded_config == config
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


# --- positions of split documents ------------------------------------------------


class RecordingAttention:
    """Causal attention over a document whose first ``len(prefix)`` tokens' k, v were computed elsewhere.

    Records each layer's (q, k, v), as a rank holding the tail of a split
    document would after fetching the head's KV from another rank.
    """

    def __init__(self, prefix_kv=None):
        self.prefix_kv = prefix_kv or []
        self.calls = []

    def __call__(self, q, k, v, *, layer):
        assert layer == len(self.calls)  # the model names each block's index, in order
        self.calls.append((q, k, v))
        if self.prefix_kv:
            k = torch.cat([self.prefix_kv[layer][0], k])
            v = torch.cat([self.prefix_kv[layer][1], v])
        n_q, n_k = q.shape[0], k.shape[0]
        # bottom-right causal: query i sits at key position n_k - n_q + i
        allowed = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
        return dense_attention(q, k, v, allowed)


def test_split_document_matches_one_call():
    torch.manual_seed(0)
    config = model_config("tiny", vocab_size=97, n_layers=2)
    model = randomize_(Transformer(config))
    L, cut = 23, 9
    tokens = torch.randint(0, 97, (L,))

    whole = RecordingAttention()
    head = RecordingAttention()
    with torch.no_grad():
        logits_whole = model(tokens, torch.arange(L), whole)
        logits_head = model(tokens[:cut], torch.arange(cut), head)
        tail = RecordingAttention(prefix_kv=[(k, v) for _, k, v in head.calls])
        logits_tail = model(tokens[cut:], torch.arange(cut, L), tail)

    # RoPE at absolute positions: the tail's first-layer q and k are the whole document's rows.
    q_whole, k_whole, _ = whole.calls[0]
    q_tail, k_tail, _ = tail.calls[0]
    torch.testing.assert_close(q_tail, q_whole[cut:])
    torch.testing.assert_close(k_tail, k_whole[cut:])
    # With the head's KV prefix, every layer and the logits agree too.
    for (q_w, k_w, v_w), (q_t, k_t, v_t) in zip(whole.calls, tail.calls):
        torch.testing.assert_close(q_t, q_w[cut:])
        torch.testing.assert_close(k_t, k_w[cut:])
    torch.testing.assert_close(torch.cat([logits_head, logits_tail]), logits_whole)


def test_positions_are_not_assumed_to_start_at_zero():
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", n_layers=1))
    calls = []
    model(torch.arange(4), torch.arange(4), lambda q, k, v, layer=None: calls.append(q) or q)
    model(torch.arange(4), torch.arange(100, 104), lambda q, k, v, layer=None: calls.append(q) or q)
    assert not torch.allclose(calls[0], calls[1])


# --- model behaviour --------------------------------------------------------------


def test_return_hidden_gives_logits_through_output_weight():
    torch.manual_seed(0)
    for tied in (False, True):
        model = Transformer(model_config("tiny", n_layers=2, tie_embeddings=tied))
        doc_ids, positions = packed_positions(DOC_LENS)
        tokens = torch.randint(0, 256, (len(doc_ids),))
        attention = document_attention(doc_ids)
        hidden = model(tokens, positions, attention, return_hidden=True)
        assert hidden.shape == (len(tokens), 128)
        torch.testing.assert_close(F.linear(hidden, model.output_weight), model(tokens, positions, attention))
        assert ("lm_head.weight" in model.state_dict()) == (not tied)


@pytest.mark.parametrize("recompute_attention", [True, False])
def test_activation_checkpointing_same_gradients(recompute_attention):
    torch.manual_seed(0)
    config = model_config("tiny", n_layers=2)
    doc_ids, positions = packed_positions(DOC_LENS)
    tokens = torch.randint(0, 256, (len(doc_ids),))
    base_attention = document_attention(doc_ids)

    def grads(model):
        calls = []

        def attention(q, k, v, layer=None):
            calls.append(1)
            return base_attention(q, k, v)

        loss = F.cross_entropy(model(tokens, positions, attention)[:-1], tokens[1:])
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}, len(calls)

    plain = Transformer(config)
    checkpointed = Transformer(config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, "full" if recompute_attention else "keep_attention")
    expected, plain_calls = grads(plain)
    actual, checkpointed_calls = grads(checkpointed)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name)
    assert plain_calls == 2
    # Core attention runs again in backward only when asked to.
    assert checkpointed_calls == (4 if recompute_attention else 2)


def test_meta_device_init_is_seeded():
    config = model_config("tiny", n_layers=2)

    def build():
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device="cpu")
        torch.manual_seed(3)
        model.init_weights()
        return model

    a, b = build(), build()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    w = a.layers["0"].attention.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005
    assert a.layers["0"].attention.o_proj.weight.std().item() < 0.015  # scaled by 1/sqrt(2 * n_layers)


def test_forward_refuses_mismatched_positions():
    model = Transformer(model_config("tiny", n_layers=1))
    with pytest.raises(ConfigError, match="positions"):
        model(torch.arange(4), torch.arange(5), lambda q, k, v, layer=None: q)
    with pytest.raises(ConfigError, match="tokens"):
        model(torch.arange(4)[None], torch.arange(4)[None], lambda q, k, v, layer=None: q)


# --- configs ----------------------------------------------------------------------


def test_presets():
    llama = model_config("llama3-8b")
    assert (llama.n_layers, llama.dim, llama.n_heads, llama.n_kv_heads, llama.ffn_dim) == (32, 4096, 32, 8, 14336)
    assert llama.head_dim == 128 and llama.vocab_size == 128256 and llama.rope_theta == 500000.0
    assert round(llama.num_params() / 1e9, 2) == 8.03
    qwen = model_config("qwen2.5-3b")
    assert qwen.qkv_bias and qwen.tie_embeddings and qwen.head_dim == 128
    assert round(qwen.num_params() / 1e9, 2) == 3.09
    big = model_config("llama-34b")
    assert (big.n_layers, big.dim, big.n_heads, big.n_kv_heads, big.ffn_dim, big.vocab_size) == (
        48, 8192, 64, 16, 22016, 32000)
    assert model_config("llama3-8b", n_layers=4).n_layers == 4
    for name in MODEL_PRESETS:
        model_config(name)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="llama3-8b") as info:
        model_config("gpt-5")
    assert info.value.field == "model"
    with pytest.raises(ConfigError, match="not a model field"):
        model_config("tiny", depth=4)


@pytest.mark.parametrize("overrides,field", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(dim=130), "dim"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(ffn_dim=-1), "ffn_dim"),
    (dict(head_dim=15), "head_dim"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(max_position=0), "max_position"),
])
def test_config_validation(overrides, field):
    with pytest.raises(ConfigError) as info:
        model_config("tiny", **overrides)
    assert info.value.field == field


def test_rope_scaling_validation():
    with pytest.raises(ConfigError, match="low_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=4.0)


# --- refused checkpoints ------------------------------------------------------------


def test_checkpoint_with_wrong_shapes_is_refused(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config["intermediate_size"] = 80
    config_path.write_text(json.dumps(hf_config))
    with pytest.raises(ConfigError) as info:
        load_hf_checkpoint(tmp_path)
    assert info.value.field.startswith("model.layers.0.mlp.")
    assert "80" in str(info.value)


def test_checkpoint_with_missing_tensor_is_refused(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        load_hf_checkpoint(tmp_path)
    assert info.value.field == "model.layers.1.self_attn.k_proj.weight"


def test_checkpoint_with_extra_tensor_is_refused(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        load_hf_checkpoint(tmp_path)
    assert info.value.field == "model.layers.0.self_attn.q_norm.weight"


@pytest.mark.parametrize("change,field", [
    # frequencies that follow the sequence's length, with documents longer than the model's context
    (dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)), "rope_parameters.rope_type"),
    (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unsupported_hf_config_is_refused(change, field):
    hf = dict(SMALL, architectures=["LlamaForCausalLM"], rope_theta=10000.0)
    hf.update(change)
    with pytest.raises(ConfigError) as info:
        config_from_hf(hf)
    assert info.value.field == field


def test_legacy_and_new_rope_fields_read_alike():
    legacy = dict(SMALL, architectures=["LlamaForCausalLM"], rope_theta=5e5,
                  rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0))
    new = dict(SMALL, architectures=["LlamaForCausalLM"],
               rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64))
    assert config_from_hf(legacy) == config_from_hf(new)


def test_chunked_cross_entropy_equals_full_logits():
    from attnpool.model.llama import chunked_cross_entropy
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(33, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 33, (50,), generator=g)
    labels[[3, 17, 49]] = -100
    full = torch.nn.functional.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum")
    gh, gw = torch.autograd.grad(full, (h, w))
    chunked = chunked_cross_entropy(h, w, labels, chunk=7)
    ch, cw = torch.autograd.grad(chunked, (h, w))
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


def test_presets_take_a_layers_override():
    assert model_config("llama3-8b", layers=4).n_layers == 4
    assert model_config("llama3-8b", layers=4) == model_config("llama3-8b", n_layers=4)
    with pytest.raises(ConfigError, match="not both"):
        model_config("tiny", layers=2, n_layers=3)


def test_presets_take_token_counts_as_sizes():
    """A window or a context length as people write them (model_args: sliding_window=4K); anything else that is
    not a count is refused by name."""
    config = model_config("tiny", sliding_window="4K", max_position="128K")
    assert (config.sliding_window, config.max_position) == (4096, 131072)
    with pytest.raises(ConfigError, match="not a token count") as err:
        model_config("tiny", sliding_window="4 kilo")
    assert err.value.field == "sliding_window"
    with pytest.raises(ConfigError, match="positive integer"):
        model_config("tiny", n_heads="4K")  # (a size only where the field counts tokens)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_rmsnorm_matches_float64_formula(dtype, tol):
    """x * weight / sqrt(mean(x^2) + eps), output and both gradients, rounded once to the input's dtype."""
    from attnpool.model.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 64, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g, dtype=torch.float64))
    grad = torch.randn(37, 64, generator=g, dtype=torch.float64)
    out = norm(x)
    out.backward(grad.to(dtype))
    assert out.dtype == dtype
    xr, wr = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    ref = wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref.backward(grad)
    for got, want in ((out, ref), (x.grad, xr.grad), (norm.weight.grad, wr.grad)):
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
