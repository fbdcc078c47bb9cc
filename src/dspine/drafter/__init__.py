"""The drafter: model (block forward, bridge), final stage, draft vocabulary, checkpoints and memory accounting."""
