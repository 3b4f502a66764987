from grpolab.commands.cli import main

main()
