"""`python -m labkit.launch MODULE:FUNCTION [ARG ...] [--results DIR]`: what every
torchrun process runs (`torchrun ... -m labkit.launch ...`), the one name for
it; the code is labkit/runtime/launch.py."""


from labkit.runtime.launch import main

if __name__ == "__main__":
    main()
