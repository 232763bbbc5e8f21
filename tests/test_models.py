"""Model adapters: the flat layer list computes exactly what the Hugging Face model computes."""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers as tf

from ptplan.executor.families.models import (MODEL_NAMES, LayeredModel, LayerSpec, _apply_overrides, _flatten, backbone_layers,
                                    build_model, model_source, preset_config)
from ptplan.planner.errors import PtplanError

TINY = ("bert-tiny", "vit-tiny", "gpt2-tiny", "llama-tiny", "roberta-tiny", "distilbert-tiny", "mistral-tiny",
        "qwen2-tiny")
HF_CLASS = {"bert": tf.BertForSequenceClassification, "vit": tf.ViTForImageClassification,
            "gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM,
            "roberta": tf.RobertaForSequenceClassification, "distilbert": tf.DistilBertForSequenceClassification,
            "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM}
BASE = {"bert": (tf.BertModel, "bert"), "vit": (tf.ViTModel, "vit"), "gpt2": (tf.GPT2Model, "transformer"),
        "llama": (tf.LlamaModel, "model"), "roberta": (tf.RobertaModel, "roberta"),
        "distilbert": (tf.DistilBertModel, "distilbert"), "mistral": (tf.MistralModel, "model"),
        "qwen2": (tf.Qwen2Model, "model")}
"""family -> (the HF base model class, its attribute in the task model)."""
MLP_OUT = {"bert": ("output.dense", "encoder.layer.1.output.dense"), "roberta": ("output.dense", "encoder.layer.1.output.dense"),
           "distilbert": ("ffn.lin2", "transformer.layer.1.ffn.lin2"), "vit": ("mlp.fc2", "layers.1.mlp.fc2"),
           "gpt2": ("mlp.c_proj", "h.1.mlp.c_proj"), "llama": ("mlp.down_proj", "layers.1.mlp.down_proj"),
           "mistral": ("mlp.down_proj", "layers.1.mlp.down_proj"), "qwen2": ("mlp.down_proj", "layers.1.mlp.down_proj")}
"""family -> (the second block's MLP output projection in layer 4 of the half model, the same in the HF base model)."""
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _tiny(name: str, granularity: str = "half", **kw) -> LayeredModel:
    kw.setdefault("seq_len", None if name.startswith("vit") else 12)
    return build_model(name, granularity=granularity, dropout=0.0, **kw)


def _reference(m: LayeredModel) -> torch.nn.Module:
    """The Hugging Face task model with the preset's own config (a tied head stays tied: qwen2-tiny) holding
    the adapter's initial weights, copied name by name: ``build_model`` initialises each layer from its own
    seed (a stage builds only its layers), so the same global seed no longer gives the same weights."""
    from ptplan.executor.training.export import hf_model

    cfg = preset_config(m.name)
    _apply_overrides(cfg, m.family, num_labels=m.num_labels, dropout=0.0, image_size=m.image_size)
    with torch.random.fork_rng(devices=[]):
        ref = HF_CLASS[m.family](cfg)
    copy = hf_model(m, {k: v.detach() for k, v in m.named_parameters()})
    state = copy.state_dict()
    missing = ref.load_state_dict({k: v for k, v in state.items() if k in ref.state_dict()}, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # tied heads: the embedding, the head's copy of it
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
    ref_emb = next(iter(getattr(ref, BASE[m.family][1]).get_input_embeddings().parameters()))
    if m.family == "vit":
        ref_emb = ref.vit.embeddings.patch_embeddings.projection.weight
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
    base, attr = BASE[m.family]
    ref = _reference(m)
    sub = getattr(ref, attr)
    assert isinstance(sub, base)
    x, _, mask = m.make_batch(2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = sub(x, output_hidden_states=True).hidden_states
        for i in range(m.num_blocks - 1):  # the last hidden state has the final norm applied (ViT, GPT-2)
            got = m.run_layers(x, 0, 1 + 2 * (i + 1), mask)
            torch.testing.assert_close(got, hs[i + 1], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", ["bert-tiny", "roberta-tiny", "distilbert-tiny"])
def test_encoder_padding_mask_matches_and_matters(name):
    m = _tiny(name)
    ref = _reference(m)
    x, _, _ = m.make_batch(2, torch.Generator().manual_seed(3))
    mask = _padding_mask(2, x.shape[1])
    with torch.no_grad():
        out = m(x, mask)
        torch.testing.assert_close(out, ref(input_ids=x, attention_mask=mask).logits, atol=ATOL, rtol=1e-5)
        # the mask is really used: without it the padded sample's token 0 (what the head reads) changes after
        # the blocks, the full sample's does not
        top = len(m.layers) - 2
        free, kept = m.run_layers(x, 0, top, None)[:, 0], m.run_layers(x, 0, top, mask)[:, 0]
        assert not torch.allclose(free[0], kept[0], atol=1e-3)
        torch.testing.assert_close(free[1], kept[1], atol=ATOL, rtol=1e-5)
        # changing a padded token does not change the output
        x2 = x.clone()
        x2[0, -1] = (x2[0, -1] % 1000) + 1
        torch.testing.assert_close(m(x2, mask), out, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny"])
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


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "mistral-tiny"])
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
    ours, theirs = MLP_OUT[m.family]
    got = m.layers[4].get_submodule(ours).weight.grad
    want = getattr(ref, BASE[m.family][1]).get_submodule(theirs).weight.grad
    assert got is not None and float(got.abs().max()) > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # and the first layer (the embedding) and the head, the ends of the gradient path
    emb = next(p for p in m.layers[0].parameters() if p.grad is not None)
    assert float(emb.grad.abs().max()) > 0


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
    assert {"bert-tiny", "bert-small", "bert-base", "bert-large", "vit-tiny", "vit-small", "vit-base", "vit-large",
            "gpt2-tiny", "gpt2", "gpt2-medium", "llama-tiny", "roberta-tiny", "distilbert-tiny", "mistral-tiny",
            "qwen2-tiny", "roberta-base", "gpt2-large", "vit-huge-patch14-224"} <= set(MODEL_NAMES)
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
    with pytest.raises(PtplanError, match="'bert' model but gpt2-tiny is a 'gpt2' model; give the folder itself"):
        build_model("gpt2-tiny", weights=minilm_dir)
    with pytest.raises(PtplanError, match="weights folder not found"):
        build_model("bert-tiny", weights=tmp_path / "nope")
    with pytest.raises(PtplanError, match="no config.json"):
        build_model("bert-tiny", weights=tmp_path)
    (tmp_path / "config.json").write_text((minilm_dir / "config.json").read_text())
    with pytest.raises(PtplanError, match=r"no \*.safetensors or pytorch_model\*.bin weight files; to build the "
                                          r"model from its config.json alone \(random init\), give the folder"):
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
    assert "or give a local Hugging Face model folder" in str(e.value)
    with pytest.raises(PtplanError, match="looks like a path but is not a folder"):
        build_model("./no-such-model")
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
    from ptplan.executor.families.models import _flatten

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


# ---- sliding windows, local folders, names, sizes, refusals --------------------------------------

def test_mistral_sliding_window_matches_hugging_face():
    """A window shorter than the sequence: the banded mask gives HF's logits, and differs from no window."""
    cfg = tf.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512, max_position_embeddings=64, sliding_window=4)
    torch.manual_seed(0)
    hf = tf.MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = _padding_mask(2, 12)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
    for granularity in ("half", "block"):
        layers, _ = _flatten("mistral", hf, granularity)
        assert layers[1].window == 4 if granularity == "half" else layers[1].attn.window == 4
        x = ids
        with torch.no_grad():
            for layer in layers:
                x = layer(x, attention_mask=mask)
        torch.testing.assert_close(x[mask.bool()], want[mask.bool()], atol=ATOL, rtol=1e-5)
    cfg.sliding_window = None
    with torch.no_grad():
        wide = tf.MistralForCausalLM(cfg).eval()
        wide.load_state_dict(hf.state_dict())
        assert not torch.allclose(wide(input_ids=ids, attention_mask=mask).logits[0, 8:], want[0, 8:], atol=1e-4)


def _save(hf_model, folder, weights: bool = True):
    hf_model.save_pretrained(folder)
    if not weights:
        for f in folder.glob("*.safetensors"):
            f.unlink()
    return folder


@pytest.mark.parametrize("family", ["roberta", "distilbert", "mistral", "qwen2"])
def test_local_folder_picks_its_adapter_and_loads_its_weights(family, tmp_path):
    """A folder is a model: its config.json's model_type picks the adapter, its weights are loaded, and the
    layer list computes what the folder's own Hugging Face model computes."""
    cfg = preset_config(f"{family}-tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)  # not build_model's seed: the weights must come from the folder
        hf = HF_CLASS[family](cfg).eval()
    d = _save(hf, tmp_path / f"my-{family}")
    m = build_model(str(d), seq_len=12, dropout=0.0)
    assert (m.family, m.name, m.num_blocks) == (family, f"my-{family}", 4)
    x, _, mask = m.make_batch(2, torch.Generator().manual_seed(1))
    mask = _padding_mask(2, 12)
    with torch.no_grad():
        out, want = m(x, mask), hf(input_ids=x, attention_mask=mask).logits
    keep = mask.bool() if family in ("mistral", "qwen2") else slice(None)
    torch.testing.assert_close(out[keep], want[keep], atol=ATOL, rtol=1e-5)
    # the same folder as --weights under a name of the same layer structure
    if family in ("mistral", "qwen2"):
        same = build_model("llama-tiny", weights=d, seq_len=12, dropout=0.0)
        assert same.family == family and same.name == f"my-{family}"
        with torch.no_grad():
            torch.testing.assert_close(same(x, mask), out, atol=0, rtol=0)


def test_config_only_folder_builds_with_random_init(tmp_path):
    """A config alone is enough (profiling needs no trained weights): random init from the seed."""
    cfg = preset_config("roberta-tiny")
    d = tmp_path / "cfg-only"
    d.mkdir()
    cfg.save_pretrained(d)
    a, b = build_model(str(d), seq_len=8, seed=0), build_model(str(d), seq_len=8, seed=0)
    c = build_model(str(d), seq_len=8, seed=1)
    assert a.family == "roberta" and a.name == "cfg-only"
    pa, pc = dict(a.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(p, dict(b.named_parameters())[k]) for k, p in pa.items())
    assert not torch.equal(pa["layers.1.attention.self.query.weight"], pc["layers.1.attention.self.query.weight"])
    # and it is the preset's architecture
    ref = build_model("roberta-tiny", seq_len=8)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [p.shape for p in a.parameters()] == [p.shape for p in ref.parameters()]


def test_real_model_name_recorded(minilm_dir, tmp_path):
    """The MiniLM is called by its Hugging Face name, not 'bert-base'; its family is still bert."""
    by_weights = build_model("bert-base", weights=minilm_dir, seq_len=8)
    by_folder = build_model(str(minilm_dir), seq_len=8)
    assert by_weights.name == by_folder.name == "nreimers/MiniLM-L6-H384-uncased"
    assert by_folder.family == "bert" and by_folder.num_blocks == 6
    wa, wb = dict(by_weights.named_parameters()), dict(by_folder.named_parameters())
    assert all(torch.equal(wa[k], wb[k]) for k in wa if not k.startswith(f"layers.{len(by_folder.layers) - 1}."))
    src = model_source("vit-huge")  # an alias records the name it stands for
    assert (src.label, src.family, src.preset["patch_size"]) == ("vit-huge-patch14-224", "vit", 14)


def test_unsupported_families_are_refused_with_the_reason(tmp_path):
    d = tmp_path / "deberta"
    d.mkdir()
    tf.DebertaV2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       vocab_size=512).save_pretrained(d)
    with pytest.raises(PtplanError, match=r"'deberta-v2' model, which ptplan refuses: .*rel_embeddings.*shared by "
                                          r"all blocks.*cannot share one parameter between stages"):
        build_model(str(d))
    e = tmp_path / "t5"
    e.mkdir()
    tf.T5Config(d_model=64, num_layers=1, num_heads=2, d_ff=128, vocab_size=100).save_pretrained(e)
    with pytest.raises(PtplanError, match="'t5' model; ptplan has adapters for the model types bert, vit"):
        build_model(str(e))
    with pytest.raises(PtplanError, match="rel_embeddings"):
        backbone_layers(tf.DebertaV2Model(tf.DebertaV2Config(hidden_size=64, num_hidden_layers=1,
                                                             num_attention_heads=4, intermediate_size=128,
                                                             vocab_size=64)))


PUBLISHED = {  # parameters of the Hugging Face base model (no task head), from the published checkpoints
    "bert-base-uncased": 109_482_240, "bert-large-uncased": 335_141_888, "bert-base-cased": 108_310_272,
    "roberta-base": 124_645_632, "roberta-large": 355_359_744, "distilroberta-base": 82_118_400,
    "distilbert-base-uncased": 66_362_880, "gpt2": 124_439_808, "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200, "vit-base-patch16-224": 86_389_248,
    "vit-large-patch16-224": 304_351_232, "vit-huge-patch14-224": 632_404_480,
    # decoders: the published totals less the untied LM head (vocab x hidden); tied ones equal their totals
    "llama-2-7b": 6_738_415_616 - 32000 * 4096, "llama-3.1-8b": 8_030_261_248 - 128256 * 4096,
    "llama-3.2-1b": 1_235_814_400, "mistral-7b": 7_241_732_096 - 32000 * 4096,
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512 - 152064 * 3584,
}


def test_hugging_face_sizes_have_the_published_parameter_counts():
    """Each named config, instantiated on the meta device (no memory), has its checkpoint's parameter count."""
    assert set(PUBLISHED) <= set(MODEL_NAMES)
    for name, want in PUBLISHED.items():
        cfg = preset_config(name)
        with torch.device("meta"):
            base = tf.AutoModel.from_config(cfg)
        assert sum(p.numel() for p in base.parameters()) == want, name


@pytest.mark.parametrize("name", ["roberta-tiny", "distilbert-tiny", "mistral-tiny", "qwen2-tiny"])
def test_new_families_export_to_folders_transformers_loads(name, tmp_path):
    """``export_hf`` writes the family's own Hugging Face class (a Mistral is a MistralForCausalLM), and
    ``AutoModelFor...from_pretrained`` of it predicts what the layer list predicts."""
    from ptplan.executor.training.export import export_hf

    m = _tiny(name, **({"num_labels": 3} if "bert" in name else {}))
    with torch.no_grad():  # weights unlike the init: what a run would have trained
        for p in m.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    export_hf(m, {k: v.detach().clone() for k, v in m.named_parameters()}, tmp_path / "out")
    auto = tf.AutoModelForCausalLM if m.family in ("mistral", "qwen2") else tf.AutoModelForSequenceClassification
    hf = auto.from_pretrained(tmp_path / "out").eval()
    assert type(hf) is HF_CLASS[m.family]
    x, _, _ = m.make_batch(2, torch.Generator().manual_seed(9))
    mask = _padding_mask(2, x.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(m(x, mask), hf(input_ids=x, attention_mask=mask).logits, atol=ATOL, rtol=1e-5)
