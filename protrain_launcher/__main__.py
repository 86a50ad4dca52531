from protrain_launcher.cli import console_main

console_main()
