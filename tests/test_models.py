"""Model adapters: the flat layer list computes exactly what the Hugging Face model computes."""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers as tf

from ptplan.executor.models import MODEL_NAMES, LayeredModel, LayerSpec, build_model
from ptplan.planner.errors import PtplanError

TINY = ("bert-tiny", "vit-tiny", "gpt2-tiny", "llama-tiny")
HF_CLASS = {"bert": tf.BertForSequenceClassification, "vit": tf.ViTForImageClassification,
            "gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM}
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _tiny(name: str, granularity: str = "half", **kw) -> LayeredModel:
    kw.setdefault("seq_len", None if name.startswith("vit") else 12)
    return build_model(name, granularity=granularity, dropout=0.0, **kw)


def _reference(m: LayeredModel) -> torch.nn.Module:
    """The Hugging Face task model with the same config and seed (so the same initial weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = HF_CLASS[m.family](m.config)
    return ref.eval()


def _padding_mask(b: int, s: int) -> torch.Tensor:
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, s - 4:] = 0  # right padding on the first sample
    return mask


@pytest.mark.parametrize("granularity", ["half", "block"])
@pytest.mark.parametrize("name", TINY)
def test_flat_layers_match_hugging_face(name, granularity):
    m = _tiny(name, granularity)
    ref = _reference(m)
    # same initial weights: the comparison below is meaningful
    emb = m.layers[0]
    ref_emb = {"bert": lambda: ref.bert.embeddings.word_embeddings.weight,
               "vit": lambda: ref.vit.embeddings.patch_embeddings.projection.weight,
               "gpt2": lambda: ref.transformer.wte.weight,
               "llama": lambda: ref.model.embed_tokens.weight}[m.family]()
    assert any(torch.equal(p, ref_emb) for p in emb.parameters())
    x, labels, mask = m.make_batch(3, torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(x, mask)
        if m.family == "vit":
            want = ref(pixel_values=x).logits
        else:
            want = ref(input_ids=x, attention_mask=mask).logits
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-5)
    # and the loss
    with torch.no_grad():
        key = "pixel_values" if m.family == "vit" else "input_ids"
        ref_loss = ref(**{key: x}, labels=labels).loss
        torch.testing.assert_close(m.loss(m(x, mask), labels), ref_loss, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_block_boundaries_match_hidden_states(name):
    m = _tiny(name, "half")
    base = {"bert": tf.BertModel, "vit": tf.ViTModel, "gpt2": tf.GPT2Model, "llama": tf.LlamaModel}[m.family]
    ref = _reference(m)
    sub = getattr(ref, {"bert": "bert", "vit": "vit", "gpt2": "transformer", "llama": "model"}[m.family])
    assert isinstance(sub, base)
    x, _, mask = m.make_batch(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = sub(x, output_hidden_states=True).hidden_states
        for i in range(m.num_blocks - 1):  # the last hidden state has the final norm applied (ViT, GPT-2)
            got = m.run_layers(x, 0, 1 + 2 * (i + 1), mask)
            torch.testing.assert_close(got, hs[i + 1], atol=ATOL, rtol=1e-5)


def test_bert_padding_mask_matches_and_matters():
    m = _tiny("bert-tiny")
    ref = _reference(m)
    x, _, _ = m.make_batch(2, torch.Generator().manual_seed(3))
    mask = _padding_mask(2, x.shape[1])
    with torch.no_grad():
        out = m(x, mask)
        torch.testing.assert_close(out, ref(input_ids=x, attention_mask=mask).logits, atol=ATOL, rtol=1e-5)
        # the mask is really used: without it the padded sample changes, the full one does not
        free = m(x, None)
        assert not torch.allclose(free[0], out[0], atol=1e-4)
        torch.testing.assert_close(free[1], out[1], atol=ATOL, rtol=1e-5)
        # changing a padded token does not change the output
        x2 = x.clone()
        x2[0, -1] = (x2[0, -1] % 1000) + 1
        torch.testing.assert_close(m(x2, mask), out, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_causal_padding_mask_matches_on_real_tokens(name):
    m = _tiny(name)
    ref = _reference(m)
    x, _, _ = m.make_batch(2, torch.Generator().manual_seed(4))
    mask = _padding_mask(2, x.shape[1])
    with torch.no_grad():
        out = m(x, mask)
        want = ref(input_ids=x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], want[keep], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("granularity", ["half", "block"])
def test_causal_lm_is_causal_layer_by_layer(name, granularity):
    m = _tiny(name, granularity)
    x, _, mask = m.make_batch(2, torch.Generator().manual_seed(5))
    t = 7
    x2 = x.clone()
    x2[:, t] = (x2[:, t] % 1000) + 1
    with torch.no_grad():
        a, b = m(x, mask), m(x2, mask)
        # layer by layer too, with and without the padding mask
        c = m.run_layers(m.run_layers(x2, 0, 3, None), 3, len(m.layers), None)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])
    torch.testing.assert_close(b, c, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_gradients_match_hugging_face(name):
    m = _tiny(name)
    ref = _reference(m)
    x, labels, mask = m.make_batch(2, torch.Generator().manual_seed(6))
    m.loss(m(x, mask), labels).backward()
    key = "pixel_values" if m.family == "vit" else "input_ids"
    kw = {} if m.family == "vit" else {"attention_mask": mask}
    ref(**{key: x}, labels=labels, **kw).loss.backward()
    # a weight in the middle of the model: the second block's MLP output projection
    got = {"bert": lambda: m.layers[4].output.dense.weight.grad,
           "vit": lambda: m.layers[4].mlp.fc2.weight.grad,
           "gpt2": lambda: m.layers[4].mlp.c_proj.weight.grad,
           "llama": lambda: m.layers[4].mlp.down_proj.weight.grad}[m.family]()
    want = {"bert": lambda: ref.bert.encoder.layer[1].output.dense.weight.grad,
            "vit": lambda: ref.vit.layers[1].mlp.fc2.weight.grad,
            "gpt2": lambda: ref.transformer.h[1].mlp.c_proj.weight.grad,
            "llama": lambda: ref.model.layers[1].mlp.down_proj.weight.grad}[m.family]()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", TINY)
def test_structure_and_signatures(name):
    half, block = _tiny(name, "half"), _tiny(name, "block")
    L = half.num_blocks
    assert len(half.layers) == len(half.specs) == 2 * L + 3
    assert len(block.layers) == len(block.specs) == L + 3
    assert [s.kind for s in half.specs] == ["embedding"] + ["attention", "mlp"] * L + ["norm", "head"]
    assert [s.kind for s in block.specs] == ["embedding"] + ["block"] * L + ["norm", "head"]
    assert [s.block for s in half.specs] == [None] + [i for i in range(L) for _ in (0, 1)] + [None, None]
    assert all(isinstance(s, LayerSpec) for s in half.specs)
    assert half.specs[1].name == "block0.attn" and block.specs[1].name == "block0"
    for layer in [*half.layers, *block.layers]:
        params = inspect.signature(layer.forward).parameters
        assert list(params)[:2] == ["x", "attention_mask"] and params["attention_mask"].default is None
    # the same seed gives the same model whatever the granularity
    x, _, mask = half.make_batch(2, torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(half(x, mask), block(x, mask), atol=ATOL, rtol=1e-5)
    assert sum(p.numel() for p in half.parameters()) == sum(p.numel() for p in block.parameters())


def test_run_layers_composes_and_checks_range():
    m = _tiny("bert-tiny")
    x, _, mask = m.make_batch(2)
    with torch.no_grad():
        whole = m(x, mask)
        split = m.run_layers(m.run_layers(x, 0, 4, mask), 4, len(m.layers), mask)
    torch.testing.assert_close(whole, split, atol=0, rtol=0)
    with pytest.raises(ValueError):
        m.run_layers(x, 3, 2)


def test_make_batch_shapes_and_dtypes():
    g = torch.Generator().manual_seed(0)
    bert = _tiny("bert-tiny")
    x, y, mask = bert.make_batch(3, g)
    assert x.shape == (3, 12) and x.dtype == torch.long and y.shape == (3,) and mask.shape == (3, 12)
    vit = build_model("vit-tiny", image_size=48, dtype=torch.bfloat16)
    assert vit.seq_len == (48 // 8) ** 2 + 1
    x, y, mask = vit.make_batch(2, g)
    assert x.shape == (2, 3, 48, 48) and x.dtype == torch.bfloat16 and mask is None
    assert vit(x).dtype == torch.bfloat16 and vit(x).shape == (2, 2)
    gpt = _tiny("gpt2-tiny")
    x, y, mask = gpt.make_batch(2, g)
    assert torch.equal(x, y) and gpt(x, mask).shape == (2, 12, gpt.config.vocab_size)


def test_defaults_and_real_sizes():
    assert set(MODEL_NAMES) == {"bert-tiny", "bert-small", "bert-base", "bert-large", "vit-tiny", "vit-small",
                                "vit-base", "vit-large", "gpt2-tiny", "gpt2", "gpt2-medium", "llama-tiny"}
    m = build_model("bert-tiny")
    assert m.seq_len == 128 and m.granularity == "half" and m.family == "bert"
    assert not m.training  # built in eval mode
    assert build_model("vit-tiny").seq_len == 17


def test_dropout_override():
    assert build_model("bert-tiny", dropout=0.0).config.hidden_dropout_prob == 0.0
    assert build_model("bert-tiny").config.hidden_dropout_prob == 0.1
    assert build_model("gpt2-tiny", dropout=0.25).config.attn_pdrop == 0.25


def test_gpt2_lm_head_is_untied_copy_of_wte():
    m = _tiny("gpt2-tiny")
    wte, head = m.layers[0].wte.weight, m.layers[-1].weight
    assert wte is not head and wte.data_ptr() != head.data_ptr()
    torch.testing.assert_close(wte, head, atol=0, rtol=0)
    assert {id(p) for p in m.layers[0].parameters()}.isdisjoint(id(p) for p in m.layers[-1].parameters())


def test_pretrained_minilm_matches_hugging_face(minilm_dir):
    m = build_model("bert-base", weights=minilm_dir, seq_len=16, dropout=0.0)
    assert m.num_blocks == 6 and m.config.hidden_size == 384 and len(m.layers) == 6 * 2 + 3
    ref = tf.BertModel.from_pretrained(minilm_dir, local_files_only=True).eval()
    torch.testing.assert_close(m.layers[1].attention.self.query.weight,
                               ref.encoder.layer[0].attention.self.query.weight, atol=0, rtol=0)
    x, _, _ = m.make_batch(2, torch.Generator().manual_seed(8))
    mask = _padding_mask(2, 16)
    with torch.no_grad():
        want = ref(input_ids=x, attention_mask=mask)
        hidden = m.run_layers(x, 0, 1 + 12, mask)
        pooled = m.run_layers(hidden, 13, 14, mask)
    torch.testing.assert_close(hidden, want.last_hidden_state, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(pooled, want.pooler_output, atol=ATOL, rtol=1e-5)


def test_pretrained_errors(minilm_dir, tmp_path):
    with pytest.raises(PtplanError, match="'bert' model but the adapter is a 'gpt2'"):
        build_model("gpt2-tiny", weights=minilm_dir)
    with pytest.raises(PtplanError, match="weights folder not found"):
        build_model("bert-tiny", weights=tmp_path / "nope")
    with pytest.raises(PtplanError, match="no config.json"):
        build_model("bert-tiny", weights=tmp_path)
    (tmp_path / "config.json").write_text((minilm_dir / "config.json").read_text())
    with pytest.raises(PtplanError, match="no \\*.safetensors or \\*.bin"):
        build_model("bert-tiny", weights=tmp_path)
    # a checkpoint whose shapes do not fit its config
    cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100)
    tf.BertModel(cfg).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text().replace('"hidden_size": 32',
                                                                                         '"hidden_size": 64'))
    with pytest.raises(PtplanError, match=r"do not match the bert architecture .* 0 missing and \d+ mismatched"
                                          r" weights, e.g. bert\..* \(checkpoint \(32,\), config \(64,\)\)"):
        build_model("bert-tiny", weights=tmp_path)


def test_bad_names_and_options():
    with pytest.raises(PtplanError) as e:
        build_model("bert-huge")
    assert "unknown model 'bert-huge'" in str(e.value) and all(n in str(e.value) for n in MODEL_NAMES)
    with pytest.raises(PtplanError, match="granularity"):
        build_model("bert-tiny", granularity="quarter")
    with pytest.raises(PtplanError, match="sequence length 1000 is outside"):
        build_model("bert-tiny", seq_len=1000)
    with pytest.raises(PtplanError, match="use --image-size"):
        build_model("vit-tiny", seq_len=10)
    with pytest.raises(PtplanError, match="not a multiple of the patch size"):
        build_model("vit-tiny", image_size=30)
    with pytest.raises(PtplanError, match="ViT models only"):
        build_model("bert-tiny", image_size=32)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_llama_adapter_runs_mistral_and_qwen2(family):
    """Mistral and Qwen2 share Llama's decoder structure: the same layer list computes their logits
    (grouped-query attention: 4 heads over 2 key/value heads; right padding on one sample)."""
    from ptplan.executor.models import _flatten

    cfg_cls, model_cls = {"mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
    cfg = cfg_cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=64,
                  tie_word_embeddings=family == "qwen2")
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = _padding_mask(2, 12)
    for granularity in ("half", "block"):
        layers, specs = _flatten("llama", hf, granularity)
        assert len(layers) == (2 * 2 if granularity == "half" else 2) + 3
        x = ids
        with torch.no_grad():
            for layer in layers:
                x = layer(x, attention_mask=mask)
            want = hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(x[mask.bool()], want[mask.bool()], atol=ATOL, rtol=1e-5)
        # a tied head is untied into a copy (a pipeline cannot share one parameter between stages)
        assert layers[-1].lm_head.weight is not layers[0].embed_tokens.weight
        assert torch.equal(layers[-1].lm_head.weight, layers[0].embed_tokens.weight) == (family == "qwen2")
