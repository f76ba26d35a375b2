"""`python -m labkit.launch MODULE:FUNCTION [ARG ...] [--results DIR]`: what every
torchrun process runs (`torchrun ... -m labkit.launch ...`); the same as
`python -m labkit.runtime.launch`, see labkit/runtime/launch.py."""


from labkit.runtime.launch import main

if __name__ == "__main__":
    main()
