from trainpod.launcher.cli import main

if __name__ == "__main__":  # not when multiprocessing re-runs it as __mp_main__
    raise SystemExit(main())
