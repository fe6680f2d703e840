"""Runnable jobs (``python -m examples.train_cifar10``, ``python -m examples.kill_and_resume``)."""
