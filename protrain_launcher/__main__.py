from protrain_launcher.entrypoint import run

run()
