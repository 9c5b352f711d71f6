"""The worker (learner) service: trains a full replica locally and streams compressed pseudo-gradients."""
