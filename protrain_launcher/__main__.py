from protrain.launcher.entrypoint import run

run()
