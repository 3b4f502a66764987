from grpolab.cli import main

main()
