"""The `dspine` command line (`dspine.cli.main`) and how it builds engines."""
