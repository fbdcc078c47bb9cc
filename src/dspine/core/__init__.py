"""The parts of one decode cycle that every engine shares: stop detection
(:mod:`dspine.core.stopping`) and the reference loop to read first
(:mod:`dspine.core.reference`)."""
