"""TRL's GRPOTrainer made to score its completions with grpolab's float64 forward."""

from __future__ import annotations

from grpolab.common.batch import Batch


def trl_scores_in_float64(trainer) -> None:
    """Make ``trainer`` (TRL's GRPOTrainer) score its completions with grpolab's float64 forward from here on.

    TRL's forward runs the LM head fused (transformers' ``fused_lm_head``) and returns float32 log-probs whatever the
    model's dtype, so its loss carries float32 rounding (about 1e-7 relative) before any objective is applied. Each call
    still runs TRL's own forward, whose log-probs and entropies must equal grpolab's (``completion_logprobs`` of the
    same ids and attention mask) to float32 rounding; then grpolab's float64 ones, with their own graph, stand in, so
    that a comparison measures the objective: TRL's loss from the log-probs on against grpolab's."""
    from grpolab.models.logprobs import completion_logprobs

    forward = trainer._get_per_token_logps_and_entropies

    def in_float64(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux = forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        P = input_ids.shape[1] - logits_to_keep
        batch = Batch(input_ids[:, :P], attention_mask[:, :P], input_ids[:, P:], attention_mask[:, P:])
        ours = completion_logprobs(model, batch, entropy=True)  # [N, T, 2]: log-probs and entropies
        m = batch.completion_mask.bool()
        assert (logps.double()[m] - ours[..., 0][m]).abs().max() < 1e-5  # TRL's fp32 head: the same, rounded
        if entropies is not None:
            assert (entropies.double()[m] - ours[..., 1][m]).abs().max() < 1e-5
        return ours[..., 0], ours[..., 1], aux

    trainer._get_per_token_logps_and_entropies = in_float64
