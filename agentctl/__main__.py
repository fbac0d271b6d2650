"""`python -m agentctl`."""

from agentctl.cli import main

main(prog_name="agentctl")
