"""Gemma 4's vision and audio towers and Qwen3-VL's vision tower, counted from their config as transformers builds them.

vLLM's gemma4_mm.py builds both towers with transformers' `AutoModel.from_config` (the audio one only where the
config has an `audio_config`) plus one projector each into the language model (`embed_vision`, `embed_audio`: one
linear of the tower's output width x the text hidden size), and skips them with `--language-model-only` (the
limits of every modality set to 0, `_mark_tower_model`). Per layer, as transformers 5.19 builds them:

* vision (`Gemma4VisionModel`): attention q, k, v, o (4 h^2 with the default heads x head_dim = h) and a gated
  MLP (gate, up, down: 3 h i); once, the patch embedding (3 x patch^2 x h) and a 2-D position table
  (2 x position_embedding_size x h).
* audio (`Gemma4AudioModel`, a Conformer): two feed-forward halves (2 x 2 x h x 4h), attention with its relative
  position projection (5 h^2) and the convolution module (pointwise h -> 2h, depthwise, pointwise h -> h: 3 h^2):
  24 h^2; once, the output projection (h x output_proj_dims).

Fields a config leaves out take the transformers class defaults (config_defaults: `{"model_type":
"gemma4_vision"}` is how Gemma 4's own configs name their vision tower). Checked against transformers'
`Gemma4ForConditionalGeneration` built on the meta device (tests/plan/test_plan_gemma4.py).
"""

from __future__ import annotations

from typing import Any

# The class defaults the published configs rely on (transformers 5.19 Gemma4VisionConfig / Gemma4AudioConfig),
# used when transformers cannot be imported: the plan runs on CPU-only CI runners without vLLM too.
_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "patch_size": 16,
    "position_embedding_size": 10240,
}
_AUDIO_DEFAULTS = {"hidden_size": 1024, "num_hidden_layers": 12, "output_proj_dims": 1536}


def _completed(sub: dict[str, Any], defaults: dict[str, int]) -> dict[str, int]:
    """The sizes the count needs: the config's own, else its transformers class defaults, else the ones above."""
    sizes = {k: v for k, v in sub.items() if k in defaults and isinstance(v, int)}
    if len(sizes) == len(defaults):
        return sizes
    from pytest_vllm_mem.plan.config_defaults import with_class_defaults

    full, _ = with_class_defaults(sub)
    return {**defaults, **{k: v for k, v in full.items() if k in defaults and isinstance(v, int)}, **sizes}


def gemma4_vision_params(config: dict[str, Any], text_hidden: int) -> int:
    """The vision tower and its projector, 0 without a vision_config."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    v = _completed(vision, _VISION_DEFAULTS)
    h, inter, layers = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    once = 3 * v["patch_size"] ** 2 * h + 2 * v["position_embedding_size"] * h
    return layers * (4 * h * h + 3 * h * inter) + once + h * text_hidden


def gemma4_audio_params(config: dict[str, Any], text_hidden: int) -> int:
    """The audio tower and its projector, 0 without an audio_config."""
    audio = config.get("audio_config")
    if not isinstance(audio, dict):
        return 0
    a = _completed(audio, _AUDIO_DEFAULTS)
    h, out = a["hidden_size"], a["output_proj_dims"]
    return a["num_hidden_layers"] * 24 * h * h + h * out + out * text_hidden


# Qwen3-VL's vision tower (transformers' Qwen3VLVisionModel, vLLM's qwen3_vl.py): a Conv3d patch embedding over
# temporal_patch_size frames, learned position embeddings, `depth` blocks (two LayerNorms, a biased QKV and output
# projection, a biased two-layer MLP), and patch mergers that fold spatial_merge_size^2 patches into the language
# model's hidden size: the final one plus one per `deepstack_visual_indexes` entry (each with a LayerNorm over the
# merged width). Equal to transformers 5.19's meta-device count on Qwen3-VL-30B-A3B-Instruct's config: 538,631,408.
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def qwen3_vl_vision_params(config: dict[str, Any]) -> int:
    """Qwen3-VL's vision tower and its mergers, 0 without a vision_config that gives their sizes."""
    v = config.get("vision_config")
    needed = ("hidden_size", "intermediate_size", "depth", "patch_size", "out_hidden_size")
    if not isinstance(v, dict) or not all(isinstance(v.get(key), int) for key in needed):
        return 0
    h, inter, out, depth = (int(v[key]) for key in ("hidden_size", "intermediate_size", "out_hidden_size", "depth"))
    patch = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * int(v["patch_size"]) ** 2 * h + h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
    merged = h * int(v.get("spatial_merge_size", 2)) ** 2
    merger = (merged * merged + merged) + (merged * out + out)
    deepstack = len(v.get("deepstack_visual_indexes") or ())
    once = patch + int(v.get("num_position_embeddings", 0)) * h
    return once + depth * block + (2 * h + merger) + deepstack * (2 * merged + merger)


__all__ = ["QWEN3_VL_TYPES", "gemma4_audio_params", "gemma4_vision_params", "qwen3_vl_vision_params"]
