"""A tiny config of every keras-hub 0.32 backbone, after keras-hub's own test configs
(`keras_hub/src/models/*/*_backbone_test.py`: the same arguments, smaller where they allow, one set
of small dimensions shared by all, so that the whole sweep compiles few distinct programs).

`BACKBONES[name]()` builds `keras_hub.models.<name>` at random. A composite backbone (Depth
Anything, SAM, Stable Diffusion 3...) is built from its parts, as keras-hub's tests build it.
The dimensions divide a (2, 4) mesh where the architecture lets them: tests/test_hub_backbones.py
loads these sharded, tests/test_layout_maps.py derives their layout maps. The text and decoder
builders take keyword arguments that change their config for one test
(`BACKBONES["GemmaBackbone"](num_key_value_heads=2)`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tests._hub import import_keras_hub

keras_hub = import_keras_hub()
hub = keras_hub.models

_TEXT = dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16)
# Four heads of each kind: the backbones with a `get_layout_map` split heads over "model" (4).
_LLM = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=16,
    intermediate_dim=32,
)
_SMOLLM = dict(
    vocabulary_size=64,
    hidden_dim=16,
    intermediate_dim=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=False,
    attention_dropout=0.0,
    rope_layer_enabled_list=[True, False],
    layer_types=["attention", "attention"],
    mlp_bias=False,
    layer_norm_epsilon=1e-6,
    max_position_embeddings=32,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
)
_T5GEMMA = dict(
    vocabulary_size=64,
    **{
        f"{side}_{arg}": value
        for side in ("encoder", "decoder")
        for arg, value in dict(
            hidden_dim=16,
            intermediate_dim=32,
            num_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            layer_types=["full_attention", "full_attention"],
        ).items()
    },
)


def _part(module: str, name: str) -> Any:
    """A keras-hub class that `keras_hub.models` does not export (an encoder of a composite)."""
    return getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)


def _text(name: str, **kwargs: Any) -> Callable[..., Any]:
    return lambda **changed: getattr(hub, name)(**{**_TEXT, **kwargs, **changed})


def _llm(name: str, **kwargs: Any) -> Callable[..., Any]:
    return lambda **changed: getattr(hub, name)(**{**_LLM, **kwargs, **changed})


def _dinov2(num_layers: int = 2, size: int = 70, **kwargs: Any) -> Any:
    return hub.DINOV2Backbone(
        patch_size=14,
        num_layers=num_layers,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        layer_scale_init_value=1.0,
        num_register_tokens=0,
        use_swiglu_ffn=False,
        image_shape=(size, size, 3),
        **kwargs,
    )


def _resnet(stacks: int = 3, **kwargs: Any) -> Any:
    return hub.ResNetBackbone(
        input_conv_filters=[64],  # keras-hub requires 64
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64] * stacks,
        stackwise_num_blocks=[1] * stacks,
        stackwise_num_strides=[1] + [2] * (stacks - 1),
        block_type="basic_block",
        use_pre_activation=False,
        **kwargs,
    )


def _mit() -> Any:
    return hub.MiTBackbone(
        layerwise_depths=[1, 1],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[8, 4],
        max_drop_path_rate=0.1,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
        hidden_dims=[8, 16],
        image_shape=(32, 32, 3),
    )


def _hgnetv2(stages: int, **kwargs: Any) -> Any:
    filters = [[8, 8, 16, 1, 2, 3], [16, 8, 32, 1, 2, 3], [32, 16, 64, 1, 2, 3]][:stages]
    return hub.HGNetV2Backbone(
        depths=[1] * stages,
        embedding_size=8,
        hidden_sizes=[f[2] for f in filters],
        stem_channels=[3, 8, 8],
        hidden_act="relu",
        use_learnable_affine_block=True,
        stackwise_stage_filters=filters,
        apply_downsample=[False] + [True] * (stages - 1),
        use_lightweight_conv_block=[False] * (stages - 1) + [True],
        **kwargs,
    )


def _vision_encoder(prefix: str) -> Any:
    return getattr(hub, f"{prefix}VisionEncoder")(16, 8, 2, 2, 16, image_shape=(32, 32, 3))


def _text_encoder(prefix: str) -> Any:
    return getattr(hub, f"{prefix}TextEncoder")(64, 8, 8, 2, 2, 16, max_sequence_length=8)


def _encoders(prefix: str) -> dict[str, Any]:
    """A vision and a text encoder of a CLIP-like backbone."""
    return dict(vision_encoder=_vision_encoder(prefix), text_encoder=_text_encoder(prefix))


def _clip_text(name: str, activation: str = "quick_gelu") -> Any:
    return _part("clip.clip_text_encoder", "CLIPTextEncoder")(
        20, 8, 8, 2, 2, 16, activation, -2, name=name
    )


def _vae() -> Any:  # 32 channels: its group normalization has 32 groups
    vae = _part("vae.vae_backbone", "VAEBackbone")
    return vae([32, 32], [1, 1], [32, 32], [1, 1], sampler_method="mode", name="vae")


def _sam() -> Any:
    return hub.SAMBackbone(
        image_encoder=hub.ViTDetBackbone(
            hidden_size=16,
            num_layers=2,
            intermediate_dim=32,
            num_heads=2,
            global_attention_layer_indices=[1],
            patch_size=16,
            num_output_channels=8,
            window_size=2,
            image_shape=(16, 16, 3),
        ),
        prompt_encoder=_part("sam.sam_prompt_encoder", "SAMPromptEncoder")(
            hidden_size=8, image_embedding_size=(8, 8), input_image_size=(16, 16)
        ),
        mask_decoder=_part("sam.sam_mask_decoder", "SAMMaskDecoder")(
            num_layers=2,
            hidden_size=8,
            intermediate_dim=32,
            num_heads=2,
            embedding_dim=8,
            iou_head_hidden_dim=8,
        ),
    )


def _blip2() -> Any:
    return hub.BLIP2Backbone(
        vision_encoder=_part("blip2.blip2_vision_encoder", "BLIP2VisionEncoder")(
            image_size=16,
            patch_size=4,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            use_patch_bias=True,
            use_class_token=True,
            use_mha_bias=True,
            use_mlp_bias=True,
            dropout_rate=0.0,
            layer_norm_epsilon=1e-6,
            initializer_range=0.02,
        ),
        qformer=_part("blip2.blip2_qformer", "BLIP2QFormer")(
            num_query_tokens=2,
            num_layers=2,
            num_heads=2,
            hidden_dim=4,
            intermediate_dim=8,
            vision_dim=8,
            cross_attention_frequency=1,
            dropout=0.0,
            layer_norm_epsilon=1e-6,
        ),
        language_model=_part("blip2.blip2_custom_opt", "BLIP2CustomOPT")(
            vocabulary_size=14,
            num_layers=2,
            num_heads=2,
            hidden_dim=4,
            intermediate_dim=8,
            num_query_tokens=2,
            qformer_hidden_dim=4,
            max_sequence_length=10,
            dropout=0.0,
            language_projection=None,
        ),
    )


def _d_fine() -> Any:
    stages = ["stage2", "stage3"]
    return hub.DFineBackbone(
        backbone=_hgnetv2(3, image_shape=(None, None, 3), out_features=stages),
        decoder_in_channels=[16, 16],
        encoder_hidden_dim=16,
        num_labels=4,
        num_denoising=0,
        learn_initial_query=False,
        num_queries=8,
        anchor_image_size=(32, 32),
        feat_strides=[8, 16],
        num_feature_levels=2,
        hidden_dim=16,
        encoder_in_channels=[32, 64],
        encode_proj_layers=[1],
        num_attention_heads=2,
        encoder_ffn_dim=32,
        num_encoder_layers=1,
        hidden_expansion=0.34,
        depth_multiplier=0.5,
        eval_idx=-1,
        num_decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
        decoder_n_points=[2, 2],
        lqe_hidden_dim=8,
        num_lqe_layers=2,
        out_features=stages,
        image_shape=(32, 32, 3),
        seed=0,
    )


def _mobilenet_v5() -> Any:
    def per_block(first: Any, second: Any) -> list[list[Any]]:
        return [[first], [second, second]]

    return hub.MobileNetV5Backbone(
        stackwise_block_types=[["er"], ["uir", "uir"]],
        stackwise_num_blocks=[1, 2],
        stackwise_num_filters=per_block(8, 16),
        stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=per_block("relu", "relu"),
        stackwise_exp_ratios=per_block(4.0, 6.0),
        stackwise_se_ratios=per_block(0.0, 0.0),
        stackwise_dw_kernel_sizes=per_block(0, 5),
        stackwise_dw_start_kernel_sizes=per_block(0, 0),
        stackwise_dw_end_kernel_sizes=per_block(0, 0),
        stackwise_exp_kernel_sizes=per_block(3, 0),
        stackwise_pw_kernel_sizes=per_block(1, 0),
        stackwise_num_heads=per_block(0, 0),
        stackwise_key_dims=per_block(0, 0),
        stackwise_value_dims=per_block(0, 0),
        stackwise_kv_strides=per_block(0, 0),
        stackwise_use_cpe=per_block(False, False),
        image_shape=(32, 32, 3),
        stem_size=8,
        use_msfa=False,
    )


def _sam3() -> Any:
    def part(module: str, name: str, **kwargs: Any) -> Any:
        return _part(f"sam3.sam3_{module}", name)(**kwargs)

    size, dims = (56, 56, 3), dict(hidden_dim=16, intermediate_dim=32, num_heads=2)
    return hub.SAM3PromptableConceptBackbone(
        vision_encoder=part(
            "vision_encoder",
            "SAM3VisionEncoder",
            image_shape=size,
            patch_size=14,
            num_layers=2,
            fpn_hidden_dim=16,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5],
            pretrain_image_shape=(28, 28, 3),
            window_size=2,
            global_attn_indexes=[1],
            **dims,
        ),
        text_encoder=part(
            "text_encoder",
            "SAM3TextEncoder",
            vocabulary_size=64,
            embedding_dim=16,
            num_layers=2,
            **dims,
        ),
        geometry_encoder=part(
            "geometry_encoder", "SAM3GeometryEncoder", num_layers=1, roi_size=7, **dims
        ),
        detr_encoder=part("detr_encoder", "SAM3DetrEncoder", num_layers=1, **dims),
        detr_decoder=part(
            "detr_decoder",
            "SAM3DetrDecoder",
            image_shape=size,
            patch_size=14,
            num_layers=1,
            num_queries=4,
            **dims,
        ),
        mask_decoder=part(
            "mask_decoder", "SAM3MaskDecoder", num_upsampling_stages=3, hidden_dim=16, num_heads=2
        ),
    )


BACKBONES: dict[str, Callable[[], Any]] = {
    "AlbertBackbone": _text("AlbertBackbone", embedding_dim=8, max_sequence_length=8),
    "BASNetBackbone": lambda: hub.BASNetBackbone(
        image_encoder=_resnet(4), num_classes=1, image_shape=(32, 32, 3)
    ),
    "BLIP2Backbone": _blip2,
    "BartBackbone": _text("BartBackbone", max_sequence_length=8),
    "BertBackbone": _text("BertBackbone", max_sequence_length=8),
    "BloomBackbone": _text("BloomBackbone"),
    "CLIPBackbone": lambda: hub.CLIPBackbone(**_encoders("CLIP"), projection_dim=8),
    "CLIPTextEncoder": lambda: _text_encoder("CLIP"),
    "CLIPVisionEncoder": lambda: _vision_encoder("CLIP"),
    "CSPNetBackbone": lambda: hub.CSPNetBackbone(
        stem_filters=8,
        stem_kernel_size=3,
        stem_strides=1,
        stackwise_strides=2,
        stackwise_depth=[1, 1],
        stackwise_num_filters=[8, 16],
        down_growth=True,
        bottle_ratio=(0.5, 1.0),
        block_ratio=(1.0, 0.5),
        expand_ratio=(2.0, 1.0),
        block_type="dark_block",
        stage_type="csp",
        stem_padding="same",
        image_shape=(16, 16, 3),
    ),
    "DFineBackbone": _d_fine,
    "DINOV2Backbone": _dinov2,
    "DINOV3Backbone": lambda: hub.DINOV3Backbone(
        patch_size=14,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(28, 28, 3),
    ),
    "DebertaV3Backbone": _text("DebertaV3Backbone", max_sequence_length=8),
    "DeepLabV3Backbone": lambda: hub.DeepLabV3Backbone(
        image_encoder=_resnet(),
        low_level_feature_key="P2",
        spatial_pyramid_pooling_key="P4",
        dilation_rates=[6, 12],
        upsampling_size=4,
        image_shape=(32, 32, 3),
    ),
    "DeiTBackbone": lambda: hub.DeiTBackbone(
        image_shape=(28, 28, 3),
        patch_size=14,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
    ),
    "DenseNetBackbone": lambda: hub.DenseNetBackbone(
        stackwise_num_repeats=[1, 1], image_shape=(16, 16, 3)
    ),
    # Four DINOv2 stages, each reassembled; 9 x 9 patches, so that the halved one is 4 x 4.
    "DepthAnythingBackbone": lambda: hub.DepthAnythingBackbone(
        image_encoder=_dinov2(4, 126, apply_layernorm=True, name="image_encoder"),
        reassemble_factors=[4, 2, 1, 0.5],
        neck_hidden_dims=[8, 8, 8, 8],
        fusion_hidden_dim=8,
        head_hidden_dim=8,
        head_in_index=-1,
        feature_keys=["stage1", "stage2", "stage3", "stage4"],
    ),
    "DistilBertBackbone": _text("DistilBertBackbone", max_sequence_length=8),
    "ESM2Backbone": _text("ESM2Backbone"),
    "ESMBackbone": _text("ESMBackbone"),
    "EdRecBackbone": lambda: hub.EdRecBackbone(
        vocab_size=64,
        num_layers_enc=2,
        num_layers_dec=2,
        hidden_dim=8,
        intermediate_dim=16,
        num_heads=2,
    ),
    # keras-hub's `num_features` is left at its default: its `get_config` does not save it.
    "EfficientNetBackbone": lambda: hub.EfficientNetBackbone(
        stackwise_kernel_sizes=[3, 3],
        stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2],
        stackwise_block_types=["fused", "unfused"],
        stackwise_width_coefficients=[1.0, 1.0],
        stackwise_depth_coefficients=[1.0, 1.0],
        input_shape=(16, 16, 3),
    ),
    "ElectraBackbone": lambda: hub.ElectraBackbone(
        vocab_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        embedding_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    ),
    "FNetBackbone": lambda: hub.FNetBackbone(
        vocabulary_size=64, num_layers=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=8
    ),
    "FalconBackbone": lambda: hub.FalconBackbone(
        vocabulary_size=64, num_layers=2, num_attention_heads=2, hidden_dim=8, intermediate_dim=16
    ),
    "FluxBackbone": lambda: hub.FluxBackbone(
        input_channels=16,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        depth_single_blocks=1,
        axes_dim=[4, 6, 6],
        theta=10_000,
        use_bias=True,
        guidance_embed=True,
        image_shape=(8, 16),
        text_shape=(8, 16),
        image_ids_shape=(8, 3),
        text_ids_shape=(8, 3),
        y_shape=(16,),
    ),
    "GPT2Backbone": _text("GPT2Backbone", max_sequence_length=8),
    # A quarter of its heads' 4 dimensions would be one rotary dimension, which keras-hub refuses.
    "GPTNeoXBackbone": _text("GPTNeoXBackbone", max_sequence_length=8, rotary_percentage=0.5),
    "Gemma3Backbone": _llm("Gemma3Backbone", head_dim=8, image_size=16),
    "Gemma3nBackbone": lambda: hub.Gemma3nBackbone(
        text_vocab_size=64,
        text_hidden_size=8,
        num_hidden_layers=1,
        pad_token_id=0,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=[16],
        hidden_activation="gelu_approximate",
        layer_types=["full_attention"],
        sliding_window=4,
        rope_theta=10000.0,
        max_position_embeddings=16,
        vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=2,
        altup_num_inputs=2,
        laurel_rank=1,
    ),
    "Gemma4Backbone": _llm("Gemma4Backbone", head_dim=8, image_size=16),
    "GemmaBackbone": _llm("GemmaBackbone", head_dim=8),
    "GptOssBackbone": _llm("GptOssBackbone", num_experts=2),
    "HGNetV2Backbone": lambda: _hgnetv2(2, image_shape=(32, 32, 3)),
    "Llama3Backbone": _llm("Llama3Backbone"),
    "LlamaBackbone": _llm("LlamaBackbone"),
    "MetaCLIP2Backbone": lambda: hub.MetaCLIP2Backbone(**_encoders("MetaCLIP2"), projection_dim=8),
    "MetaCLIP2TextEncoder": lambda: _text_encoder("MetaCLIP2"),
    "MetaCLIP2VisionEncoder": lambda: _vision_encoder("MetaCLIP2"),
    "MiTBackbone": _mit,
    "MistralBackbone": _llm("MistralBackbone"),
    "MixtralBackbone": _llm("MixtralBackbone", num_experts=2),
    "MobileNetBackbone": lambda: hub.MobileNetBackbone(
        stackwise_expansion=[[64], [96]],
        stackwise_num_blocks=[1, 1],
        stackwise_num_filters=[[16], [32]],
        stackwise_kernel_size=[[3], [3]],
        stackwise_num_strides=[[2], [2]],
        stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]],
        stackwise_padding=[[1], [1]],
        output_num_filters=64,
        depthwise_filters=16,
        depthwise_stride=2,
        depthwise_residual=False,
        last_layer_filter=64,
        image_shape=(32, 32, 3),
    ),
    "MobileNetV5Backbone": _mobilenet_v5,
    "MoonshineBackbone": lambda: hub.MoonshineBackbone(
        vocabulary_size=64,
        filter_dim=16,  # its hidden size: keras-hub builds another, but cannot call it
        encoder_num_layers=2,
        decoder_num_layers=2,
        hidden_dim=16,
        intermediate_dim=32,
        encoder_num_heads=2,
        decoder_num_heads=2,
    ),
    "OPTBackbone": _text("OPTBackbone", max_sequence_length=8),
    "PARSeqBackbone": lambda: hub.PARSeqBackbone(
        image_encoder=hub.ViTBackbone(
            image_shape=(16, 32, 3),
            patch_size=(4, 8),
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            mlp_dim=32,
            use_class_token=False,
            name="image_encoder",
        ),
        vocabulary_size=20,
        max_label_length=8,
        decoder_hidden_dim=16,
        num_decoder_layers=1,
        num_decoder_heads=2,
        decoder_mlp_dim=32,
        dropout_rate=0.0,
        attention_dropout=0.0,
    ),
    "PaliGemmaBackbone": lambda: hub.PaliGemmaBackbone(
        vocabulary_size=64,
        image_size=16,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
        vit_patch_size=4,
        vit_num_heads=2,
        vit_hidden_dim=8,
        vit_num_layers=2,
    ),
    "Phi3Backbone": _llm("Phi3Backbone"),
    "Qwen2Backbone": _llm("Qwen2Backbone"),
    "Qwen3Backbone": _llm("Qwen3Backbone", head_dim=8),
    "Qwen3MoeBackbone": _llm("Qwen3MoeBackbone", moe_intermediate_dim=16, num_experts=4),
    "Qwen3_5Backbone": _llm("Qwen3_5Backbone", head_dim=8),
    "Qwen3_5MoeBackbone": lambda: hub.Qwen3_5MoeBackbone(
        **{k: v for k, v in _LLM.items() if k != "intermediate_dim"},
        head_dim=8,
        moe_intermediate_dim=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        top_k=2,
    ),
    "QwenBackbone": _llm("QwenBackbone"),
    "QwenMoeBackbone": _llm(
        "QwenMoeBackbone",
        moe_intermediate_dim=16,
        shared_expert_intermediate_dim=16,
        num_experts=4,
    ),
    "RWKV7Backbone": lambda: hub.RWKV7Backbone(
        hidden_size=16, head_size=8, num_layers=2, vocabulary_size=64, intermediate_dim=32
    ),
    "ResNetBackbone": lambda: _resnet(2, image_shape=(16, 16, 3)),
    "RetinaNetBackbone": lambda: hub.RetinaNetBackbone(
        image_encoder=_resnet(), min_level=3, max_level=4, use_p5=False, image_shape=(32, 32, 3)
    ),
    "RobertaBackbone": _text("RobertaBackbone", max_sequence_length=8),
    "RoformerV2Backbone": _text("RoformerV2Backbone", head_size=4),
    "SAM3PromptableConceptBackbone": _sam3,
    "SAMBackbone": _sam,
    "SegFormerBackbone": lambda: hub.SegFormerBackbone(image_encoder=_mit(), projection_filters=8),
    "SigLIPBackbone": lambda: hub.SigLIPBackbone(**_encoders("SigLIP")),
    "SigLIPTextEncoder": lambda: _text_encoder("SigLIP"),
    "SigLIPVisionEncoder": lambda: _vision_encoder("SigLIP"),
    "SmolLM3Backbone": lambda: hub.SmolLM3Backbone(**_SMOLLM),
    "SmolLMBackbone": lambda: hub.SmolLMBackbone(**_SMOLLM),
    "StableDiffusion3Backbone": lambda: hub.StableDiffusion3Backbone(
        mmdit_patch_size=2,
        mmdit_hidden_dim=16,
        mmdit_num_layers=2,
        mmdit_num_heads=2,
        mmdit_position_size=16,
        mmdit_qk_norm=None,
        mmdit_dual_attention_indices=None,
        vae=_vae(),
        clip_l=_clip_text("clip_l"),
        clip_g=_clip_text("clip_g", "gelu"),
        image_shape=(32, 32, 3),
    ),
    "SwinTransformerBackbone": lambda: hub.SwinTransformerBackbone(
        image_shape=(32, 32, 3), embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4
    ),
    "T5Backbone": _text("T5Backbone"),
    "T5Gemma2Backbone": lambda: hub.T5Gemma2Backbone(**_T5GEMMA),
    "T5GemmaBackbone": lambda: hub.T5GemmaBackbone(**_T5GEMMA),
    "VGGBackbone": lambda: hub.VGGBackbone(
        stackwise_num_repeats=[1, 1], stackwise_num_filters=[16, 32], image_shape=(16, 16, 3)
    ),
    "ViTBackbone": lambda: hub.ViTBackbone(
        image_shape=(28, 28, 3), patch_size=14, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16
    ),
    "ViTDetBackbone": lambda: hub.ViTDetBackbone(
        hidden_size=8,
        num_layers=2,
        intermediate_dim=16,
        num_heads=2,
        global_attention_layer_indices=[1],
        image_shape=(32, 32, 3),
        patch_size=16,
        window_size=2,
    ),
    "VideoPrismBackbone": lambda: hub.VideoPrismBackbone(
        num_frames=2,
        patch_size=4,
        hidden_dim=8,
        intermediate_dim=16,
        num_heads=2,
        num_spatial_layers=1,
        num_temporal_layers=1,
        num_auxiliary_layers=0,
        image_shape=(8, 8, 3),
    ),
    "WhisperBackbone": _text(
        "WhisperBackbone", max_encoder_sequence_length=16, max_decoder_sequence_length=8
    ),
    "XLMRobertaBackbone": _text("XLMRobertaBackbone", max_sequence_length=8),
    "XLNetBackbone": _text("XLNetBackbone"),
    "XceptionBackbone": lambda: hub.XceptionBackbone(
        stackwise_conv_filters=[[16, 32], [32, 64]],
        stackwise_pooling=[False, True],
        image_shape=(16, 16, 3),
    ),
}

# Backbone classes of `keras_hub.models` not in `BACKBONES`, each with the reason.
NOT_BUILT: dict[str, str] = {
    "FeaturePyramidBackbone": "keras-hub's abstract base of its vision backbones: no model of its own",
}


def backbone_names() -> set[str]:
    """Every backbone class `keras_hub.models` exports (the encoders of CLIP-like backbones too)."""
    return {
        name
        for name in dir(hub)
        if isinstance(getattr(hub, name), type)
        and issubclass(getattr(hub, name), hub.Backbone)
        and getattr(hub, name) is not hub.Backbone
    }
