"""TRL's GRPOTrainer computing the loss of one batch, and its gradients, for test_grpo.py.

Runs in an environment of its own, with trl (whose datasets needs pyarrow 21+ and numpy 2, which
the project's test environment pins below; .ci/run makes it, MINDSPEED_TRL_PYTHON names it):

    python trl_reference.py BATCH.npz HF_FOLDER SETTINGS_JSON OUT_PREFIX

BATCH.npz holds prompt_ids [B, P], completion_ids [B, C], completion_mask [B, C], advantages
[B], old and reference per-token log-probabilities [B, C]. SETTINGS_JSON is a list of settings
(one process for all: importing trl takes seconds). For each, a GRPOTrainer is built on the
Hugging Face folder (a tokenizer of two tokens: the batch is given as ids) and its own
``_compute_loss`` runs on the batch, in training mode, then backward. OUT_PREFIX<k>.npz: "loss"
and each parameter's gradient under its Hugging Face name.
"""

from __future__ import annotations

import json
import sys
import tempfile

import numpy as np


def main(batch_path: str, folder: str, settings: str, out_prefix: str) -> None:
    for k, one in enumerate(json.loads(settings)):
        run(batch_path, folder, one, f"{out_prefix}{k}.npz")


def run(batch_path: str, folder: str, settings: dict, out_path: str) -> None:
    import datasets
    import torch
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    batch = dict(np.load(batch_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")),
        pad_token="<pad>", eos_token="<unk>")
    rows = batch["completion_ids"].shape[0]
    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), beta=settings["beta"], epsilon=settings["epsilon"],
                            epsilon_high=settings["epsilon_high"], loss_type=settings["loss_type"],
                            temperature=settings["temperature"],
                            max_completion_length=settings["max_completion_length"],
                            num_generations=settings["num_generations"], per_device_train_batch_size=rows,
                            gradient_accumulation_steps=1, report_to=[], use_cpu=True, bf16=False,
                            scale_rewards="group", use_bias_correction_kl=settings["kl_correction"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                              args=config, train_dataset=datasets.Dataset.from_list([{"prompt": "x"}] * rows),
                              processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set per step by its training loop
    tensor = {k: torch.tensor(v) for k, v in batch.items()}
    inputs = {"prompt_ids": tensor["prompt_ids"], "prompt_mask": torch.ones_like(tensor["prompt_ids"]),
              "completion_ids": tensor["completion_ids"], "completion_mask": tensor["completion_mask"],
              "advantages": tensor["advantages"], "old_per_token_logps": tensor["old"],
              "ref_per_token_logps": tensor["reference"]}
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().numpy() for n, p in trainer.model.named_parameters() if p.grad is not None}
    np.savez(out_path, loss=np.array(float(loss.detach()), np.float64), **grads)


if __name__ == "__main__":
    main(*sys.argv[1:5])
