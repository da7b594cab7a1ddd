"""The field's architectures from ``transformers``, built from small configs (seeded, nothing
downloaded), for tier 2's localisation corpus (guard.zoo.faults.family_cases).

Each builder returns a module whose forward takes the model's one input positionally and
returns one tensor (the logits, or the encoder's last hidden state), as a deployment's export
wrapper does; module paths are the library's own under ``model.`` (``model.bert.encoder.layer.0
.attention.self.query``). Normalisation layers get trained-looking affine parameters (and
BatchNorm statistics), as in guard.zoo.layouts. ``transformers`` is an optional dependency of
the benchmark: import this module only where it is installed.
"""

from __future__ import annotations

import numpy as np

# ``type: ignore[call-arg]`` on the configs below: transformers 5 declares each config's
# __init__ without the PreTrainedConfig keywords it takes at run time (num_labels,
# attn_implementation).


def _wrap(model, field: str):
    import torch
    from torch import nn

    class Export(nn.Module):
        """model(x).<field>: one input, one tensor out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return getattr(self.model(x), field)

    wrapped = Export().eval()
    from guard.zoo.layouts import _settle_norms

    _settle_norms(wrapped, 0)
    with torch.no_grad():  # RMSNorm and ConvNeXt's own LayerNorm: a gamma that is not all ones
        generator = torch.Generator().manual_seed(1)
        for _name, module in wrapped.named_modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm") or kind == "ConvNextLayerNorm":
                module.weight.copy_(0.8 + 0.4 * torch.rand(module.weight.shape,
                                                            generator=generator))
    return wrapped


def _ids(n: int, tokens: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(700 + seed).integers(0, vocab, size=(n, tokens), dtype=np.int64)


def _images(n: int, seed: int, size: int = 32) -> np.ndarray:
    return np.random.default_rng(800 + seed).standard_normal((n, 3, size, size)).astype(np.float32)


def bert(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,  # type: ignore[call-arg]
                          num_attention_heads=4, intermediate_size=64,
                          max_position_embeddings=32, num_labels=4)
    return _wrap(t.BertForSequenceClassification(config).eval(), "logits")


def vit(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,  # type: ignore[call-arg]
                         num_attention_heads=4, intermediate_size=64, num_labels=5)
    return _wrap(t.ViTForImageClassification(config).eval(), "logits")


def hf_resnet(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],  # type: ignore[call-arg]
                            layer_type="basic", num_labels=5)
    return _wrap(t.ResNetForImageClassification(config).eval(), "logits")


def convnext(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],  # type: ignore[call-arg]
                              num_labels=5, image_size=32)
    return _wrap(t.ConvNextForImageClassification(config).eval(), "logits")


def mobilenet_v2(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=5)  # type: ignore[call-arg]
    return _wrap(t.MobileNetV2ForImageClassification(config).eval(), "logits")


def whisper_encoder(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4,
                             encoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
                             decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                             vocab_size=100, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                             decoder_start_token_id=2)
    return _wrap(t.WhisperModel(config).encoder.eval(), "last_hidden_state")


def llama(seed: int = 0):
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,  # type: ignore[call-arg]
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=32, attn_implementation="eager")
    return _wrap(t.LlamaForCausalLM(config).eval(), "logits")


def inputs(family: str, n: int = 4, seed: int = 1) -> dict[str, np.ndarray]:
    if family in ("bert", "llama"):
        return {"x": _ids(n, 8, 100, seed)}
    if family == "whisper_encoder":
        return {"x": np.random.default_rng(900 + seed).standard_normal((n, 16, 32)).astype(
            np.float32)}
    return {"x": _images(n, seed)}


BUILDERS = {"bert": bert, "vit": vit, "hf_resnet": hf_resnet, "convnext": convnext,
            "mobilenet_v2": mobilenet_v2, "whisper_encoder": whisper_encoder, "llama": llama}


# -- full-size members, for tier 2's cost (benchmarks/activation_cost.py --large) ----------------
def bert_base(seed: int = 0):
    """BERT-base's shape (12 layers, hidden 768, 12 heads, 110M parameters), seeded."""
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.BertConfig(num_labels=2)  # type: ignore[call-arg]  # bert-base-uncased's defaults
    return _wrap(t.BertForSequenceClassification(config).eval(), "logits")


def resnet50(seed: int = 0):
    """ResNet-50's shape (bottleneck stages 3-4-6-3, widths 256-2048, 25M parameters)."""
    import torch
    import transformers as t

    torch.manual_seed(seed)
    config = t.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],  # type: ignore[call-arg]
                            depths=[3, 4, 6, 3], layer_type="bottleneck", num_labels=1000)
    return _wrap(t.ResNetForImageClassification(config).eval(), "logits")


LARGE = {"bert-base": (bert_base, lambda seed: {"x": _ids(1, 128, 30522, seed)}),
         "resnet50": (resnet50, lambda seed: {"x": _images(1, seed, size=224)})}
