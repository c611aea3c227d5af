from model.cli import main

main()
