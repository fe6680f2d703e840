"""The writer lease on a checkpoint root: its record, taking it, keeping it (renewal, fencing), waiting.

One writer at a time per root, judged by observing the record change, never by clocks. Which
checkpoints a fenced or superseded writer may touch is the checkpoint layer's.
"""
