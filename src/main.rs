//! The `nmt` binary: parse the command line and dispatch; errors become one line on stderr.

use clap::Parser;
use nmt::cli::{Cli, Command};
use nmt::commands;

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Tokenize(cmd) => commands::tokenize(cmd),
        Command::Eval(args) => commands::eval(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
