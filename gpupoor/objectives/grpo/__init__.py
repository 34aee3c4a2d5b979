"""GRPO: its arithmetic (`loss`: group advantages, the clipped policy loss), its rollouts (`rollout`: sampled
answers and their log-probabilities) and the loop's loss and eval functions around them (`objective`)."""
