"""Timing that the metric help texts promise and the rank side keeps.

A leaf module (it imports nothing), so a training process can import it without the exposition library.
"""

# seconds between reads of a GPU value (loss, grad norm); the value is never staler than two. Three samples of
# the default 2 s interval: a read of ~0.27 ms (an H200 host, cold) then costs 0.0045% of a core, inside the
# 0.005% its spacing aims at (a 5 s cap read every 4 s there, the last sample inside it: 0.0068%)
READ_MAX_GAP = 6.0
