"""The bundled shapes task learned by a tiny vision-language model on a CPU → benchmarks/results/vision_sft.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_vision_sft.py [--family qwen3_vl|gemma3] [--steps 300]
        [--train 2000] [--eval 100]

A random vision-language model built by transformers is imported with `hf import`, then fine-tuned
with dataset_type=sft on the shapes task's image chat records (maxlite/data/vision_task.py: how many
shapes, what colour, what shape), the tower trained too (vision_train=all: a random tower has nothing
to keep). `qwen3_vl`: a Qwen3-VL (2-layer ViT of width 64, patch 8; 4-layer decoder of width 128; the
bundled tokenizer with Qwen's vision tokens and a ChatML-style template). `gemma3`: a Gemma 3 of the
same widths (2-layer SigLIP tower on 64-pixel squares in 8-pixel patches pooled to 16 soft tokens; 4
decoder layers, 3 sliding-window : 1 global; Gemma's turn and image tokens and a Gemma-style template
that writes one <start_of_image> per image). Held-out exact-match accuracy of greedy answers (`generate`
with the image, in the chat template) before and after, and the minutes the fine-tuning took on this
machine. Chance: the most frequent answer of the eval split.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import cpuinfo, write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "vision_sft.json"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


MODELS = {"qwen3_vl": "random Qwen3-VL: ViT 2×64 (patch 8), decoder 4×128",
          "gemma3": "random Gemma 3: SigLIP 2×64 (64-pixel squares, patch 8, 16 soft tokens), decoder 4×128 "
                    "(3 sliding-window : 1 global)"}


def random_gemma3(path: pathlib.Path) -> None:
    """The random Gemma 3, its tokenizer and image processor, saved under `path`."""
    from tests.hf_models import save_gemma3_chat_model

    save_gemma3_chat_model(path, 128, ["sliding_attention"] * 3 + ["full_attention"], 32, 64)


def random_model(path: pathlib.Path) -> None:
    """The random Qwen3-VL, its tokenizer and image processor, saved under `path`."""
    import torch
    import transformers

    from maxlite.data.tokenizer import BUNDLED_DIR

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[2:], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<|im_start|>"], special_tokens=True)
    tok.chat_template = TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=4104, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True}, tie_word_embeddings=True),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=0, vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    transformers.Qwen3VLForConditionalGeneration(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    transformers.Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                          image_std=[0.5] * 3, size={"shortest_edge": 32 * 32,
                                                                     "longest_edge": 64 * 64}).save_pretrained(str(path))


def accuracy(source: str, eval_path: pathlib.Path) -> tuple[float, list[str]]:
    """Held-out exact-match accuracy of greedy answers, and the answers."""
    from maxlite.data.images import load_image
    from maxlite.data.vision_task import answer_accuracy
    from maxlite.generate import Sampling, generate_text, load

    records = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
    questions = [r["messages"][0]["content"][1]["text"] for r in records]
    images = [[load_image(r["messages"][0]["content"][0]["image"], base_dir=eval_path.parent, where="eval")]
              for r in records]
    cfg, params, mesh = load(source, overrides=["dtype=float32"])
    texts, _ = generate_text(cfg, params, questions, None, Sampling(max_new_tokens=4), mesh, chat=True, images=images)
    return answer_accuracy(texts, eval_path), texts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(MODELS), default="qwen3_vl")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()

    from maxlite import checkpoints
    from maxlite.bridge import hf, params as P
    from maxlite.data.vision_task import write_shapes_task
    from maxlite.train import train

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_vision_sft_"))
    (random_gemma3 if args.family == "gemma3" else random_model)(work / "hf")
    task = write_shapes_task(work / "shapes", train=args.train, eval=args.eval, seed=0)
    cfg, pure = hf.import_hf(str(work / "hf"))
    checkpoints.save_params(str(work / "base"), cfg, P.to_state(cfg, P.to_jax_inplace(pure)))
    before, _ = accuracy(str(work / "base"), task["eval"])
    argv = ["dataset_type=sft", f"dataset_path={task['train']}", "sft_template=auto", "vision_train=all",
            f"steps={args.steps}", "learning_rate=0.002", "warmup_steps_fraction=0.05", "max_target_length=128",
            "max_image_patches=256", "per_device_batch_size=16", "checkpoint_period=0", "eval_interval=0",
            f"load_parameters_path={work}/base", "run_name=sft", f"base_output_directory={work}",
            "enable_tensorboard=false", "write_report=false"]
    run = hf.import_hf(str(work / "hf"), argv)[0]  # the model's keys from its config.json, as `hf import` writes them
    start = time.perf_counter()
    train(run)
    minutes = (time.perf_counter() - start) / 60
    after, texts = accuracy(str(work / "sft"), task["eval"])
    answers = [json.loads(line)["messages"][-1]["content"] for line in task["eval"].read_text().splitlines()]
    chance = collections.Counter(answers).most_common(1)[0][1] / len(answers)
    losses = [json.loads(line)["loss"] for line in open(work / "sft" / "metrics.jsonl") if '"loss"' in line]
    write_result({"model": MODELS[args.family], "family": args.family, "train_records": args.train,
                  "eval_records": args.eval, "steps": args.steps, "global_batch": run.global_batch_size,
                  "accuracy_before": before, "accuracy_after": after, "chance_most_frequent_answer": chance,
                  "first_loss": losses[0], "last_loss": losses[-1], "train_minutes": round(minutes, 2),
                  "sample_answers": texts[:8],
                  "cpu_model": cpuinfo("model name"), "cpu_avx512_bf16": "avx512_bf16" in cpuinfo("flags").split(), "cpu_count": len(__import__("os").sched_getaffinity(0))},
                 args.out)


if __name__ == "__main__":
    main()
