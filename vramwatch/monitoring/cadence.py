"""Timing that the metric help texts promise and the rank side keeps.

A leaf module (it imports nothing), so a training process can import it without the exposition library.
"""

READ_MAX_GAP = 5.0  # seconds between reads of a GPU value (loss, grad norm); the value is never staler than two
